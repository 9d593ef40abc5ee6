"""Joining mode: `elasticrun --serve` and agents that `elasticrun --join` it.

Real processes on loopback: one serving driver, several agents with their own
--host-name, each running real workers of tests/workloads/train_job.py.
"""

import json
import re
import secrets
import signal
import subprocess
import sys

import pytest
from support.adversary import FAKE_MAC, FirstSightVandal, Outsider
from support.jobs import REPO
from support.join_cluster import ELASTICRUN
from support.procs import job_workers
from support.waits import wait_until

from elastic import protocol
from elastic.checkpoint.format import list_checkpoints

WORKER_LINE = re.compile(r"^\[\d+\]<stdout>:worker \d+ finished as rank \d+ of \d+$", re.M)


def _workers_on(job, host):
    return {pid for pid, env in job_workers(job.out).items()
            if env.get("ELASTIC_HOSTNAME") == host}


@pytest.mark.slow
def test_agents_join_grow_the_job_and_a_sigtermed_agent_drains(join_job):
    job = join_job(["-np", "2", "--min-np", "1", "--worker-timeout", "10"],
                   env={"JOB_HOLD": "3,6"}).start()
    job.join("node-a")
    job.join("node-b")
    job.wait_step(3, size=2)
    job.join("node-c")                                  # a pod added by `kubectl scale`
    job.wait_for(lambda: re.search(r"round \d+: 3 workers", job.output()) is not None,
                 "the job to grow to 3")
    job.release(3)
    job.wait_step(6, size=3)
    job.signal_agent("node-b", signal.SIGTERM)          # pod eviction
    job.wait_for(lambda: re.search(r"round \d+: 2 workers", job.output().split(
        "draining")[-1]) is not None, "the job to shrink to 2 without node-b")
    job.release(6)
    code = job.finish()
    job.assert_ok(code, final_size=2)
    assert job.wait_agent("node-b") == 0, job.agent_output("node-b")
    out = job.output()
    assert "agent on node-b is draining" in out
    # A graceful leave, as a SIGTERMed worker's: at a commit, no rollback, no blacklist.
    assert re.search(r"worker \d+ on node-b left at commit \d+ \(preempted\)", out), out[-5000:]
    assert "restoring the last commit" not in out, out[-5000:]
    assert "blacklisting host node-b" not in out, out[-5000:]
    assert "agent on node-b drained and left" in out, out[-5000:]      # gone, not lost
    assert "agent on node-b sent no heartbeat" not in out, out[-5000:]
    # Output reaches the driver's console with the usual prefix and stays on the agent too.
    assert len(WORKER_LINE.findall(out)) == 2, out[-3000:]
    for name in ("node-a", "node-c"):
        assert job.wait_agent(name) == 0, job.agent_output(name)
        assert WORKER_LINE.search(job.agent_output(name)), job.agent_output(name)
    hosts = {r["host"] for r in job.steps()}
    assert hosts == {"node-a", "node-b", "node-c"}, hosts
    assert not job_workers(job.out)


@pytest.mark.slow
def test_a_sigkilled_agent_is_a_lost_host_and_its_worker_dies(join_job):
    job = join_job(["-np", "3", "--min-np", "2", "--worker-timeout", "5"],
                   env={"JOB_HOLD": "3"}).start()
    for name in ("node-a", "node-b", "node-c"):
        job.join(name)
    job.wait_step(3, size=3)
    victims = _workers_on(job, "node-c")
    assert victims
    job.signal_agent("node-c", signal.SIGKILL)
    wait_until(lambda: not _workers_on(job, "node-c"), "node-c's worker to die with its agent",
               timeout=30, output=job.output)
    job.wait_for(lambda: "agent on node-c sent no heartbeat" in job.output(),
                 "the driver to lose node-c")
    job.release(3)
    code = job.finish()
    job.assert_ok(code, final_size=2)
    assert "blacklisting host node-c" in job.output()


@pytest.mark.slow
def test_wrong_secret_is_refused_and_a_killed_driver_leaves_no_orphan(join_job, tmp_path):
    """Also: no driver back within --driver-grace, the workers stop as on a SIGTERM
    (every one at the same commit, written as the final checkpoint) (issue 27)."""
    ckpt = tmp_path / "ckpt"
    job = join_job(["-np", "2", "--worker-timeout", "10", "--checkpoint-dir", str(ckpt)],
                   env={"JOB_HOLD": "3"}).start()
    job.join("node-a", extra=["--driver-grace", "2"])    # no driver back within 2 s
    job.join("node-b", extra=["--driver-grace", "2"])
    job.wait_step(3, size=2)

    wrong = tmp_path / "wrong-secret"
    wrong.write_text("not-the-job-secret\n")

    def agent(secret_file, name):
        return subprocess.Popen(
            ELASTICRUN + ["--join", f"127.0.0.1:{job.port}", "--secret-file", str(secret_file),
                          "--host-name", name, sys.executable, "-c", "pass"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=job.env)
    intruder, twin = agent(wrong, "intruder"), agent(job.secret_file, "node-a")
    out, err = intruder.communicate(timeout=120)
    assert intruder.returncode != 0
    assert err.strip().count("\n") == 0, err
    assert "refused by the driver" in err and "secret" in err
    assert "Traceback" not in err + out
    _, err = twin.communicate(timeout=120)
    assert twin.returncode != 0 and "in use by another live agent" in err, err
    assert "intruder" not in job.output()

    assert len(job_workers(job.out)) == 2
    job.proc.send_signal(signal.SIGKILL)
    job.proc.wait()
    left_at = set()
    for name in ("node-a", "node-b"):
        assert job.wait_agent(name, timeout=60) != 0
        text = job.agent_output(name)
        own = [line for line in text.splitlines() if line.startswith("elasticrun: error:")]
        assert len(own) == 1 and "lost contact with the driver" in own[0], own
        assert "no driver came back within --driver-grace 2 s" in own[0], own
        assert "Traceback" not in text
        left_at |= {int(n) for n in re.findall(r"left the job at commit (\d+)", text)}
    wait_until(lambda: not job_workers(job.out), "every worker to be gone", timeout=30)
    assert len(left_at) == 1, left_at            # a graceful stop: one commit for all
    assert list_checkpoints(str(ckpt))[-1][0] == left_at.pop()


def _agent(job, secret_file, name):
    return subprocess.Popen(
        ELASTICRUN + ["--join", f"127.0.0.1:{job.port}", "--secret-file", str(secret_file),
                      "--host-name", name, sys.executable, "-c", "pass"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=job.env)


@pytest.mark.slow
def test_an_outsider_cannot_keep_agents_out_or_make_the_hello_lie(join_job, tmp_path):
    """Without the secret, an outsider squats every slot-like key, floods the store with
    registrations under forged names, overwrites every key of the job once at first sight
    (registrations, answers, spawn requests, reports, heartbeats, rounds) and forges the
    hello: the right secret still joins, a wrong one is still refused with one line, and
    the job ends as if nothing happened."""
    job = join_job(["-np", "1", "--max-np", "2", "--worker-timeout", "10"],
                   env={"JOB_HOLD": "3"}).start()
    job.join("node-a")
    job.wait_step(3, size=1)
    o = Outsider("127.0.0.1", job.port, timeout=2)     # it comes back quickly once the job ends
    ns = o.namespace(marks=("//agent/",))        # the agents' keys (the workers' are apart)
    o.set_many([f"{ns}agent/slot/{i}" for i in range(1, 10001)], b"squatted",
               "every slot an agent could claim")
    forged = FAKE_MAC + b".1." + json.dumps({"host": "evil", "slots": 64}).encode()
    o.set_many([f"{ns}agent/{secrets.token_hex(16)}-{'0' * 16}/info" for _ in range(2000)],
               forged, "registrations under names with forged tags")
    real = [k for k in o.keys() if k.startswith(ns + "agent/") and k.endswith("/info")
            and "0" * 16 not in k]
    assert real, "node-a's registration is visible"
    o.set(f"{ns}agent/{secrets.token_hex(16)}-{'1' * 16}/info", o.get(real[0]),
          "node-a's registration copied under another name")
    vandal = FirstSightVandal(o, (ns, o.namespace()), skip=("/slot/", "0" * 16), every=0.1)
    vandal.start()
    nonce = secrets.token_hex(16)
    o.set(protocol.HELLO_KEY, b"garbage", "a garbage hello")
    o.set(protocol.HELLO_KEY, json.dumps(
        {"nonce": nonce, "proof": protocol.serve_proof("not-the-secret", nonce)}),
        "a hello that proves another secret")
    wrong = tmp_path / "wrong-secret"
    wrong.write_text("not-the-secret-of-this-job\n")
    intruder = _agent(job, wrong, "intruder")
    job.join("node-b")
    try:
        job.wait_for(lambda: re.search(r"round \d+: 2 workers", job.output()) is not None,
                     "node-b to join despite the outsider")
        out, err = intruder.communicate(timeout=120)
        assert intruder.returncode == 1 and err.strip().count("\n") == 0, \
            err[-2000:] + job.output()[-4000:]
        assert "refused by the driver" in err and "secret" in err
        assert "Traceback" not in out + err
        job.release(3)
        job.assert_ok(job.finish(), final_size=2)
    finally:
        vandal.stop()
    # Among what it overwrote: node-b's registration and the driver's answer, the rounds.
    for part in ("/info", "/accepted", "//round/"):
        assert any(part in k for k in vandal.hit), (part, sorted(vandal.hit))
    assert len(vandal.hit) > 20, sorted(vandal.hit)
    for name in ("node-a", "node-b"):
        assert job.wait_agent(name) == 0, job.agent_output(name)
    out = job.output()
    assert "agent joined: node-b" in out
    assert "evil" not in out and "intruder" not in out
    assert len(re.findall(r"agent joined:", out)) == 2, out[-3000:]


@pytest.mark.slow
def test_a_worker_cannot_seal_a_request_an_agent_obeys(join_job):
    """Workers hold a key derived from the job secret (protocol.worker_key), not the
    secret: a spawn request a compromised worker seals with it, written where the
    agent reads its requests, is ignored (the agent warns), and nothing starts."""
    from elastic.auth import Sealer
    job = join_job(["-np", "1", "--worker-timeout", "10"], env={"JOB_HOLD": "3"}).start()
    job.join("node-a")
    job.wait_step(3)
    secret = job.secret_file.read_text().strip()
    [(pid, env)] = job_workers(job.out).items()
    assert protocol.worker_key(secret).encode() not in open(f"/proc/{pid}/environ", "rb").read()
    raw = protocol.connect("127.0.0.1", job.port, 30)
    beats = [m for m in (re.match(r"^(.*)agent/([^/]+)/beat$", k) for k in raw.list_keys()) if m]
    assert len(beats) == 1, raw.list_keys()
    prefix, name = beats[0].group(1), beats[0].group(2)
    namespace = prefix.rstrip("/")
    forger = Sealer(protocol.worker_key(secret), job=namespace)
    request = {"op": "spawn", "worker_id": "999", "env": {"JOB_FORGED": "1"}}
    for seq in range(1, 6):
        key = protocol.AgentKeys.request(name, seq)
        raw.set(prefix + key, forger.seal(key, json.dumps(request, sort_keys=True).encode()))
    wait_until(lambda: "ignored control-store key" in job.agent_output("node-a"),
               "the agent to refuse the forged request", output=lambda: job.agent_output("node-a"))
    assert all(e.get("ELASTIC_WORKER_ID") != "999" for e in job_workers(job.out).values())
    job.release(3)
    code = job.finish()
    job.assert_ok(code, final_size=1)
    del raw


@pytest.mark.parametrize("argv, message", [
    (["--serve", "-np", "1"], "need --secret-file"),
    (["--serve", "--secret-file", "{secret}", "-np", "1", "-H", "localhost:1"],
     "takes its hosts from the agents"),
    (["--serve", "--secret-file", "{secret}", "-np", "1", "python3"],
     "training command goes to each"),
    (["--serve", "--secret-file", "{secret}", "-np", "1", "--port", "70000"],
     "not a port number"),
    (["--join", "127.0.0.1:1", "--secret-file", "{secret}"], "needs the training command"),
    (["--join", "nowhere", "--secret-file", "{secret}", "python3"], "is not HOST:PORT"),
    (["--join", "127.0.0.1:1", "--secret-file", "/nonexistent", "python3"],
     "No such file"),
    (["--join", "127.0.0.1:1", "--secret-file", "{secret}", "--slots", "0", "python3"],
     "--slots must be at least 1"),
    (["--join", "127.0.0.1:1", "--secret-file", "{secret}", "--host-name", "a,b", "python3"],
     "--host-name"),
    (["-np", "1", "--secret-file", "{secret}", "python3"], "go with --serve or --join"),
])
def test_bad_serve_and_join_flags_give_one_line(tmp_path, capsys, argv, message):
    from elastic.runner import cli
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    assert cli.main([a.replace("{secret}", str(secret)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("mode", [["--serve", "-np", "1"], ["--join", "127.0.0.1:1"]])
@pytest.mark.parametrize("secret, message", [
    ("s", "is 1 bytes; a job secret needs at least 16"),
    ("0123456789abcde", "is 15 bytes"),
    ("replace-me-with-openssl-rand-hex-32", "the example's placeholder"),
])
def test_a_weak_secret_is_refused_with_one_line(tmp_path, capsys, mode, secret, message):
    from elastic.runner import cli
    path = tmp_path / "secret"
    path.write_text(secret + "\n")
    argv = mode + ["--secret-file", str(path)] + (["python3"] if "--join" in mode else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_the_kubernetes_example_ships_the_refused_placeholder():
    """If the example's placeholder changes, the refusal must follow it."""
    from elastic.auth import EXAMPLE_SECRETS
    text = (REPO / "examples" / "kubernetes" / "secret.yaml").read_text()
    assert any(p.decode() in text for p in EXAMPLE_SECRETS)


@pytest.mark.slow
def test_no_driver_at_the_address_is_one_line(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    from support.harness import free_port
    proc = subprocess.run(
        ELASTICRUN + ["--join", f"127.0.0.1:{free_port()}", "--secret-file", str(secret),
                      "--join-timeout", "1", "python3"],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1
    assert proc.stderr.strip() == proc.stderr.strip().splitlines()[0]
    assert "cannot reach a driver" in proc.stderr
