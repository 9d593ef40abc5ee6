"""The serving driver's agent hub against a real TCPStore, without processes.

Only values signed with the job secret count: a forged registration or
heartbeat is ignored, never fatal.
"""

import json
import time

from harness import free_port

from elastic import protocol
from elastic.protocol import AgentKeys, ControlStore
from elastic.runner.agents import AgentHub

SECRET = "hub-test-secret"


def _wait(predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _hub():
    port = free_port()
    master = protocol.connect("127.0.0.1", port, 30, is_master=True)
    hub = AgentHub(timeout_s=2.0)
    hub.attach("127.0.0.1", port, SECRET, sink=None)
    return master, hub


def test_signed_registrations_are_admitted_and_forged_ones_ignored():
    master, hub = _hub()
    try:
        ours = ControlStore(master, SECRET)
        # An outsider who guessed the namespace still cannot sign: a bad MAC is absent.
        ours.raw.compare_set(AgentKeys.slot(1), "", "t1")
        payload = json.dumps({"host": "evil", "slots": 8}).encode()
        ours.raw.set(AgentKeys.info(1), b"0" * 64 + payload)
        ours.raw.compare_set(AgentKeys.slot(2), "", "t2")
        ours.put(AgentKeys.info(2), {"host": "good", "slots": 2, "pid": 1, "token": "t2"})
        assert _wait(lambda: hub.discover() == {"good": 2}), hub.discover()
        assert ours.get(AgentKeys.accepted(2)) == {"ok": True}
        assert ours.get(AgentKeys.accepted(1)) is None
        # A second live agent under the same name is refused.
        ours.raw.compare_set(AgentKeys.slot(3), "", "t3")
        ours.put(AgentKeys.info(3), {"host": "good", "slots": 1, "pid": 2, "token": "t3"})
        assert _wait(lambda: ours.get(AgentKeys.accepted(3)) is not None)
        assert ours.get(AgentKeys.accepted(3))["ok"] is False
        # Without heartbeats the agent is lost and leaves discovery.
        assert _wait(lambda: hub.discover() == {}, timeout=30)
    finally:
        hub.close(wait_s=0)


def test_hello_proves_the_secret_and_a_wrong_one_does_not_match():
    master, hub = _hub()
    try:
        hello = json.loads(bytes(master.get(protocol.HELLO_KEY)))
        assert hello["proof"] == protocol.serve_proof(SECRET, hello["nonce"])
        assert hello["proof"] != protocol.serve_proof("other", hello["nonce"])
        # One overwrite by an outsider does not last: the hub publishes again.
        master.set(protocol.HELLO_KEY, "garbage")
        assert _wait(lambda: bytes(master.get(protocol.HELLO_KEY)) != b"garbage")
    finally:
        hub.close(wait_s=0)
