"""The serving driver's agent hub against a real TCPStore, without processes.

Only values signed with the job secret count: a forged registration or
heartbeat is ignored, never fatal.
"""

import json
import time

from support.harness import free_port

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


def _hub(timeout_s=2.0):
    port = free_port()
    master = protocol.connect("127.0.0.1", port, 30, is_master=True)
    hub = AgentHub(timeout_s=timeout_s)
    hub.attach("127.0.0.1", port, SECRET, sink=None)
    return master, hub


def test_signed_registrations_are_admitted_and_forged_ones_ignored():
    master, hub = _hub()
    try:
        ours = ControlStore(master, SECRET)
        good, twin = (protocol.agent_name(SECRET, t) for t in ("t-good", "t-twin"))
        # An outsider who guessed the namespace still cannot sign: a bad MAC is absent,
        # and a name whose tag does not verify is not even read.
        payload = json.dumps({"host": "evil", "slots": 8}).encode()
        ours.raw.set(AgentKeys.info(protocol.agent_name("other", "t-evil")),
                     ours.sealer.seal(AgentKeys.info("x"), payload))
        forged = protocol.agent_name(SECRET, "t-forged")
        ours.raw.set(AgentKeys.info(forged), b"0" * 64 + b".1." + payload)
        ours.put(AgentKeys.info(good), {"host": "good", "slots": 2, "pid": 1})
        assert _wait(lambda: hub.discover() == {"good": 2}), hub.discover()
        assert ours.get(AgentKeys.accepted(good)) == {"ok": True}
        assert ours.get(AgentKeys.accepted(forged)) is None
        # An answer an outsider overwrites comes back (the hub keeps it until the agent beats).
        ours.raw.set(AgentKeys.accepted(good), b"garbage")
        assert _wait(lambda: ours.get(AgentKeys.accepted(good)) == {"ok": True})
        # A second live agent under the same name is refused.
        ours.put(AgentKeys.info(twin), {"host": "good", "slots": 1, "pid": 2})
        assert _wait(lambda: ours.get(AgentKeys.accepted(twin)) is not None)
        assert ours.get(AgentKeys.accepted(twin))["ok"] is False
        # Without heartbeats the agent is lost and leaves discovery.
        assert _wait(lambda: hub.discover() == {}, timeout=30)
    finally:
        hub.close(wait_s=0)


def test_agent_names_carry_a_tag_only_the_secret_makes():
    name = protocol.agent_name(SECRET, "0123abcd")
    assert protocol.is_agent_name(SECRET, name)
    assert not protocol.is_agent_name("other", name)
    assert not protocol.is_agent_name(SECRET, "0123abcd-" + "0" * 16)
    assert not protocol.is_agent_name(SECRET, "0123abcd")
    assert AgentKeys.registered(AgentKeys.info(name)) == name
    assert AgentKeys.registered(AgentKeys.beat(name)) is None
    assert AgentKeys.registered("agent/a/b/info") is None


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


def test_requests_and_answers_come_back_until_read_and_reports_are_acknowledged():
    """The spawn request an outsider overwrites is put back until the agent's beat says
    it read it (then it goes); a report read is acknowledged, so the agent may drop it."""
    master, hub = _hub(timeout_s=60)
    try:
        ours = ControlStore(master, SECRET)
        name = protocol.agent_name(SECRET, "tok1")
        ours.put(AgentKeys.info(name), {"host": "a", "slots": 1, "pid": 1})
        assert _wait(lambda: hub.discover() == {"a": 1})
        ours.put(AgentKeys.beat(name), {"seq": 1, "received": 0})
        handle = hub.start("0", "a", {"JOB": "1"})
        key = AgentKeys.request(name, 1)
        assert _wait(lambda: (ours.get(key) or {}).get("op") == "spawn")
        ours.raw.set(key, b"garbage")
        assert _wait(lambda: (ours.get(key) or {}).get("op") == "spawn")     # healed
        ours.put(AgentKeys.beat(name), {"seq": 2, "received": 1})
        assert _wait(lambda: not ours.present(key))                           # read: gone
        ours.put(AgentKeys.report(name, 1), {"out": [["0", "stdout", "hi"]], "exits": [["0", 0]]})
        assert _wait(lambda: handle.poll() == 0)
        assert _wait(lambda: ours.get(AgentKeys.read(name)) == {"reports": 1})
    finally:
        hub.close(wait_s=0)
