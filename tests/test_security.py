"""The control plane against a party that can reach the store but lacks the secret.

The driver's TCPStore accepts any TCP client, so the protection is in the
values: keys live under a namespace derived from the job secret and every
value that steers the job carries an HMAC bound to its key (elastic/protocol.py).
"""

import ast
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from support.harness import free_port
from support.jobs import REPO, WORKLOAD, Job, sizes_in_order
from support.procs import cmdline as _cmdline
from support.procs import job_workers

from elastic import protocol as control
from elastic.protocol import ControlStore, Keys

# -- helpers -----------------------------------------------------------------------------------


def job_secret(env):
    """The workers' key, as a worker of a job run with JOB_SECRET_OUT wrote it down
    (it is no longer in a worker's environment)."""
    return (Path(env["JOB_OUT"]) / f"secret.{env[control.ENV_WORKER_ID]}").read_bytes()


def raw_client(addr, port):
    return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=30),
                         wait_for_workers=False)


def held_job(tmp_path):
    job = Job(tmp_path, ["-np", "2", "-H", "localhost:2"],
              env={"JOB_HOLD": "3", "JOB_SECRET_OUT": "1"}).start()
    job.wait_step(3)
    workers = job_workers(job.out)
    assert workers, "no worker process found"
    return job, workers


# -- a. knowing the port is not enough ---------------------------------------------------------
@pytest.mark.slow
def test_the_store_port_alone_does_not_reveal_the_plan(tmp_path):
    job, workers = held_job(tmp_path)
    try:
        env = next(iter(workers.values()))
        addr, port = env[control.ENV_ADDR], env[control.ENV_PORT]
        store = raw_client(addr, port)
        # The plain key names are not there: they live under a secret-derived namespace.
        for key in (Keys.LATEST_ROUND, Keys.plan(1), Keys.ready(env[control.ENV_WORKER_ID]),
                    Keys.heartbeat(env[control.ENV_WORKER_ID])):
            assert not store.check([key]), key
        # A ControlStore with a wrong secret looks into another namespace and sees nothing.
        wrong = ControlStore(store, secrets.token_hex(32))
        assert wrong.get(Keys.LATEST_ROUND) is None
        assert wrong.get(Keys.plan(1)) is None
        assert not wrong.has(Keys.ready(env[control.ENV_WORKER_ID]))
        # Control: with the job's secret the very same connection reads the plan.
        right = ControlStore(store, job_secret(env))
        assert right.get(Keys.LATEST_ROUND) == {"round": 1}
        plan = right.get(Keys.plan(1))
        ids = sorted(e[control.ENV_WORKER_ID] for e in workers.values())
        assert control.decode_ids(plan["ids"]) == ids and plan["size"] == len(ids)
        for wid in ids:
            assert right.get(Keys.member(1, wid))["worker_id"] == wid
        # The secret is never on a command line (driver or workers).
        secret = job_secret(env).decode()
        for pid in [job.proc.pid, *workers]:
            assert secret not in _cmdline(pid), pid
        del wrong, right, store
    finally:
        job.release(3)
    assert job.finish() == 0, job.output()[-3000:]


@pytest.mark.slow
def test_a_worker_keeps_no_secret_in_its_environment(tmp_path):
    """Read at elastic.init(), then gone: not in /proc/PID/environ, not in a child's."""
    job, workers = held_job(tmp_path)
    try:
        for pid, env in workers.items():
            secret = job_secret(env)
            assert len(secret) >= 16
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert secret not in f.read(), pid
            child = (job.out / f"child-env.{env[control.ENV_WORKER_ID]}").read_bytes()
            assert secret not in child and b"ELASTIC_SECRET" not in child, child
    finally:
        job.release(3)
    assert job.finish() == 0, job.output()[-3000:]


# -- b. forged values read as absent, never as an error -----------------------------------------
@pytest.fixture
def store():
    master = control.connect("127.0.0.1", free_port(), 30, is_master=True)
    yield master
    del master


def quiet_store(store, secret="secret-x"):
    warnings = []
    return ControlStore(store, secret, warn=warnings.append), warnings


def test_a_tampered_value_reads_as_absent_with_one_warning(store):
    cs, warnings = quiet_store(store)
    plan = {"round": 1, "members": [{"worker_id": "0", "rank": 0}]}
    cs.put(Keys.plan(1), plan)
    assert cs.get(Keys.plan(1)) == plan
    blob = bytes(cs.raw.get(Keys.plan(1)))
    tampered = blob.replace(b'"worker_id": "0"', b'"worker_id": "9"')
    assert tampered != blob
    cs.raw.set(Keys.plan(1), tampered)
    assert cs.get(Keys.plan(1)) is None
    # A flipped MAC digit, a bare payload without a MAC, garbage, and an empty value as well.
    flipped = (b"0" if blob[:1] != b"0" else b"1") + blob[1:]
    for bad in (flipped, blob[65:], b"\x00" * 64 + b"{}", b"garbage", b""):
        cs.raw.set(Keys.plan(1), bad)
        assert cs.get(Keys.plan(1)) is None
        assert not cs.has(Keys.plan(1))
    assert len(warnings) == 1 and "round/1/plan" in warnings[0], warnings
    assert cs.rejected.count == 1 + 4 * 2   # every read of a forgery counts; empty is just absent
    cs.put(Keys.plan(1), plan)         # the real writer's value is taken again
    assert cs.get(Keys.plan(1)) == plan


def test_a_value_signed_for_one_key_is_rejected_under_another(store):
    cs, _ = quiet_store(store)
    cs.put(Keys.plan(1), {"round": 1, "members": []})
    cs.put(Keys.LATEST_ROUND, {"round": 1})
    # Replay round 1's signed plan as round 2's, and the latest-round pointer as a plan.
    cs.raw.set(Keys.plan(2), bytes(cs.raw.get(Keys.plan(1))))
    assert cs.get(Keys.plan(2)) is None
    cs.raw.set(Keys.plan(3), bytes(cs.raw.get(Keys.LATEST_ROUND)))
    assert cs.get(Keys.plan(3)) is None


def test_an_older_value_replayed_is_rejected(store):
    cs, warnings = quiet_store(store)
    cs.put(Keys.LATEST_ROUND, {"round": 1})
    old = bytes(cs.raw.get(Keys.LATEST_ROUND))
    assert cs.get(Keys.LATEST_ROUND) == {"round": 1}
    cs.put(Keys.LATEST_ROUND, {"round": 2})
    assert cs.get(Keys.LATEST_ROUND) == {"round": 2}
    cs.raw.set(Keys.LATEST_ROUND, old)                  # a correctly signed, older value
    assert cs.get(Keys.LATEST_ROUND) is None
    assert "older value replayed" in warnings[0]
    heartbeat = Keys.heartbeat("3")
    cs.put(heartbeat, {"beat": 1})
    first = bytes(cs.raw.get(heartbeat))
    cs.put(heartbeat, {"beat": 2})
    assert cs.get(heartbeat) == {"beat": 2}
    cs.raw.set(heartbeat, first)
    assert cs.get(heartbeat) is None                    # nobody beats for a dead worker


def test_a_value_signed_with_another_secret_is_rejected(store):
    mine, _ = quiet_store(store, "secret-x")
    theirs, _ = quiet_store(store, "secret-y")
    theirs.put(Keys.LATEST_ROUND, {"round": 99})
    assert mine.get(Keys.LATEST_ROUND) is None          # another namespace
    # Even written straight into our namespace, their signature does not verify.
    mine.raw.set(Keys.LATEST_ROUND, bytes(theirs.raw.get(Keys.LATEST_ROUND)))
    assert mine.get(Keys.LATEST_ROUND) is None


def test_a_value_with_non_ascii_bytes_in_the_mac_is_rejected_cleanly(store):
    cs, _ = quiet_store(store)
    cs.put(Keys.LATEST_ROUND, {"round": 1})
    blob = bytes(cs.raw.get(Keys.LATEST_ROUND))
    cs.raw.set(Keys.LATEST_ROUND, b"\xff" + blob[1:])
    assert cs.get(Keys.LATEST_ROUND) is None


def test_kept_values_are_put_back_after_overwrite_or_delete(store):
    cs, _ = quiet_store(store)
    cs.put(Keys.LATEST_ROUND, {"round": 4}, keep=True)
    cs.put(Keys.plan(4), {"round": 4, "members": []}, keep=True)
    assert cs.heal() == 0
    cs.raw.set(Keys.LATEST_ROUND, b"garbage")
    cs.raw.delete_key(Keys.plan(4))
    assert cs.heal() == 2
    assert cs.get(Keys.LATEST_ROUND) == {"round": 4}
    assert cs.get(Keys.plan(4)) == {"round": 4, "members": []}
    cs.forget(Keys.plan(4))
    cs.raw.delete_key(Keys.plan(4))
    assert cs.heal() == 0 and cs.get(Keys.plan(4)) is None


# -- c. a worker with the wrong secret cannot join ----------------------------------------------------
@pytest.mark.slow
def test_a_worker_with_a_wrong_secret_cannot_join(tmp_path):
    job, workers = held_job(tmp_path)
    env = next(iter(workers.values()))
    intruder_env = {k: v for k, v in job.env.items() if k != control.ENV_SECRET_FILE}
    intruder_env.update({
        control.ENV_ADDR: env[control.ENV_ADDR], control.ENV_PORT: env[control.ENV_PORT],
        control.ENV_SECRET: "wrong", control.ENV_WORKER_ID: "intruder",
    })
    log = open(tmp_path / "intruder.log", "wb")
    intruder = subprocess.Popen([sys.executable, str(WORKLOAD)], env=intruder_env, cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Let the intruder get as far as it can: registered (in its own namespace) or exited.
        spy = ControlStore(raw_client(env[control.ENV_ADDR], env[control.ENV_PORT]), "wrong")
        deadline = time.monotonic() + 240
        while intruder.poll() is None and not spy.has(Keys.ready("intruder")):
            assert time.monotonic() < deadline, "the intruder neither registered nor exited"
            time.sleep(0.1)
        assert intruder.poll() != 0, "an intruder must not end as if it had trained"
        print("intruder", f"exited with code {intruder.returncode}"
              if intruder.poll() is not None else "registered and waits for a round")
        job.release(3)
        code = job.finish()
        finals = job.assert_ok(code, final_size=2)
        assert sizes_in_order(job.steps()) == [2]
        assert "intruder" not in {r["worker"] for r in job.steps()}
        assert "intruder" not in {f["worker"] for f in finals}
        assert not (job.out / "steps.intruder.jsonl").exists() or \
            not (job.out / "steps.intruder.jsonl").read_text().strip()
        assert "intruder" not in job.output()
        del spy
    finally:
        if intruder.poll() is None:
            os.killpg(intruder.pid, signal.SIGKILL)
        intruder.wait(30)
        log.close()


# -- d. nothing on the control plane unpickles -------------------------------------------------------
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve"}


def _control_plane_sources():
    package = REPO / "elastic"
    return [package / "protocol.py", package / "worker" / "runtime.py",
            *sorted((package / "runner").glob("*.py"))]


def test_the_control_plane_never_unpickles():
    sources = _control_plane_sources()
    assert len(sources) > 3
    offences = []
    for path in sources:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            else:
                names = []
            offences += [f"{path.name}:{node.lineno} imports {n}" for n in names
                         if n in UNSAFE_MODULES]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("loads", "load", "Unpickler"):
                owner = node.func.value
                if not (isinstance(owner, ast.Name) and owner.id == "json"):
                    offences.append(f"{path.name}:{node.lineno} calls "
                                    f"{ast.unparse(node.func)}")
            if isinstance(node, ast.Name) and node.id in ("eval", "exec"):
                offences.append(f"{path.name}:{node.lineno} uses {node.id}")
    assert not offences, offences


def test_control_values_are_json_on_the_wire(store):
    cs = ControlStore(store, "secret-x")
    cs.put(Keys.plan(1), {"round": 1, "members": []})
    blob = bytes(cs.raw.get(Keys.plan(1)))
    payload = blob.split(b".", 2)[2]
    assert json.loads(payload) == {"round": 1, "members": []}
    assert not payload.startswith(b"\x80")      # not a pickle protocol header


# -- e. the data plane: this torch build has no TLS transport for gloo -------------------------------
def test_this_torch_build_offers_no_gloo_tls_transport():
    """What the README's trust model says: GLOO_DEVICE_TRANSPORT=TCP_TLS is not built in
    (the plain TCP transport is). If a torch build ever has it, this fails: expose it then."""
    code = ("import torch.distributed as d\n"
            "try:\n    d.ProcessGroupGloo.create_device(interface='lo'); print('built')\n"
            "except RuntimeError as e:\n    print(e)\n")
    seen = {}
    for transport in ("TCP", "TCP_TLS"):
        env = dict(os.environ, GLOO_DEVICE_TRANSPORT=transport)
        seen[transport] = subprocess.run([sys.executable, "-c", code], env=env, text=True,
                                         capture_output=True, timeout=120).stdout.strip()
    assert seen["TCP"] == "built", seen
    assert "unsupported gloo device" in seen["TCP_TLS"], seen
