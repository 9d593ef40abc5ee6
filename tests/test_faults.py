"""Faults with real processes and real signals: hung workers, a dying driver,
interrupts, and fencing of a worker that comes back from an older round.

Every wait polls a condition under a generous deadline (a loaded 2-core
machine must pass); no test sleeps a fixed time to let something happen.
"""

import json
import os
import secrets
import signal
import socket
import subprocess
import sys

import pytest
from support.harness import REPO, free_port, publish_round
from support.jobs import WORKLOAD, Job, assert_exactly_once, assert_memberships, hosts_by_rank, sizes_in_order
from support.procs import assert_no_worker_left, job_workers, pid_of
from support.procs import state as proc_state
from support.waits import wait_until

from elastic import protocol as control
from elastic.protocol import ControlStore, Keys

pytestmark = pytest.mark.slow

GONE_WITHIN_S = 10
# A third host that is this machine too: its own name, which works whether or not
# ELASTIC_SSH_LOOPBACK sends 127.0.0.2 and up through ssh.
HOST3 = socket.gethostname() if socket.gethostname() not in ("localhost", "127.0.0.1") \
    else socket.getfqdn()


# -- processes, found the way an operator would: through /proc -----------------------


def argv0(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def reap_driver(job, timeout=60):
    try:
        return job.proc.wait(timeout)
    finally:
        job.close_log()


# -- a. a hung worker is evicted ---------------------------------------------------------
def test_hung_worker_is_evicted_and_killed_and_the_rest_finish(tmp_path):
    job = Job(tmp_path, ["-np", "3", "--min-np", "2", "--worker-timeout", "4",
                         "-H", f"localhost:1,127.0.0.1:1,{HOST3}:1"],
              env={"JOB_FAULT": "5:1:stop"}).start()
    marker = job.out / "fault.0"
    job.wait_for(marker.exists, "rank 1 to stop itself")
    stopped_id = wait_until(lambda: marker.read_text(), "the fault marker's worker id", 30)
    pid = pid_of(job.out, stopped_id)
    wait_until(lambda: proc_state(pid) == "T", f"worker {stopped_id} to be stopped", 30)
    job.wait_for(lambda: "evicted" in job.output(), "the hung worker's eviction")
    # The driver kills it (SIGKILL works on a stopped process) while the job goes on.
    wait_until(lambda: proc_state(pid) is None, f"evicted worker {stopped_id} to be killed", 30)
    finals = job.assert_ok(job.finish(), final_size=2)
    out = job.output()
    assert f"worker {stopped_id} on 127.0.0.1 sent no heartbeat" in out, out[-4000:]
    assert "blacklisting host 127.0.0.1" in out
    records = job.steps()
    assert sizes_in_order(records)[0] == 3 and sizes_in_order(records)[-1] == 2
    last = max(r["round"] for r in records)
    assert set(hosts_by_rank(records, last).values()) == {"localhost", HOST3}
    assert all(r["round"] == 1 for r in records if r["worker"] == stopped_id)
    assert stopped_id not in {f["worker"] for f in finals}


# -- b. the driver is SIGKILLed ------------------------------------------------------------
def test_driver_sigkill_leaves_no_worker_running(tmp_path):
    job = Job(tmp_path, ["-np", "2", "-H", "localhost:1,127.0.0.1:1"],
              env={"JOB_HOLD": "3"}).start()
    job.wait_step(3)
    workers = job_workers(job.out)
    assert len(workers) == 2, workers
    os.kill(job.proc.pid, signal.SIGKILL)     # the driver only, not its process group
    assert reap_driver(job) == -signal.SIGKILL
    assert_no_worker_left(job)


def test_driver_sigkill_while_newcomers_import_torch_leaves_no_worker_running(tmp_path):
    job = Job(tmp_path, ["-np", "1", "--max-np", "3"], hosts=["localhost:1"],
              env={"JOB_HOLD": "3"}).start()
    job.wait_step(3)
    first = set(job_workers(job.out))
    assert len(first) == 1, first
    job.set_hosts(["localhost:1", "127.0.0.1:1", f"{HOST3}:1"])

    def newcomers_running_python():
        # Wait for setpriv to hand over to python: from then on the kernel's
        # parent-death signal is armed; earlier, the driver is only mid-spawn.
        new = {pid: env for pid, env in job_workers(job.out).items() if pid not in first}
        return len(new) == 2 and all(argv0(pid) == sys.executable for pid in new) and new

    newcomers = wait_until(newcomers_running_python, "two newcomers to be spawned", 120,
                           interval=0.01)
    os.kill(job.proc.pid, signal.SIGKILL)
    assert reap_driver(job) == -signal.SIGKILL
    # They were still starting up: none of them had trained a step.
    assert not any(r["worker"] in {e["ELASTIC_WORKER_ID"] for e in newcomers.values()}
                   for r in job.steps())
    assert_no_worker_left(job)


# -- c. SIGINT / SIGTERM to the driver ---------------------------------------------------------
@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_driver_interrupt_stops_every_worker(tmp_path, signum, code):
    job = Job(tmp_path, ["-np", "2", "-H", "localhost:2"], env={"JOB_HOLD": "3"}).start()
    job.wait_step(3)
    assert len(job_workers(job.out)) == 2
    os.kill(job.proc.pid, signum)
    assert job.finish(timeout=60) == code, job.output()[-3000:]
    assert f"stopped by signal {int(signum)}" in job.output()
    assert_no_worker_left(job)


# -- d. fencing: a worker from an older round cannot come back ------------------------------------
class _Worker:
    def __init__(self, worker_id, env, logdir):
        self.id = worker_id
        self.stdout_path = logdir / f"{worker_id}.out"
        self.stderr_path = logdir / f"{worker_id}.err"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKLOAD)], env={**env, control.ENV_WORKER_ID: worker_id},
                stdout=out, stderr=err, cwd=REPO, start_new_session=True)

    def stderr(self):
        return self.stderr_path.read_text(errors="replace")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def _records(out, worker_id):
    path = out / f"steps.{worker_id}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_worker_of_an_older_round_is_fenced_out(tmp_path):
    """Plays the driver: round 1 is A+B; A hangs (SIGSTOP); round 1 is aborted and
    round 2 is B alone. When A wakes up it must leave (exit 0) without touching
    round 2, and a worker that is in no plan at all must never join."""
    port, secret = free_port(), secrets.token_hex(16)
    store = control.connect("127.0.0.1", port, 60, is_master=True)
    cs = ControlStore(store, secret)
    publish_round(cs, 1, ["A", "B"])
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ)
    env.update({
        control.ENV_ADDR: "127.0.0.1", control.ENV_PORT: str(port), control.ENV_SECRET: secret,
        "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
        "ELASTIC_COLLECTIVE_TIMEOUT": "120", "JOB_OUT": str(out), "JOB_HOLD": "3,8",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    })
    workers = {wid: _Worker(wid, env, tmp_path) for wid in ("A", "B", "stranger")}
    a, b, stranger = workers["A"], workers["B"], workers["stranger"]

    def alive_or_fail(*ws):
        for w in ws:
            if w.proc.poll() is not None:
                raise AssertionError(f"worker {w.id} exited {w.proc.returncode}:\n{w.stderr()}")

    def check(predicate):
        alive_or_fail(b, stranger)
        return predicate()

    try:
        wait_until(lambda: alive_or_fail(a) or check(
            lambda: all(any(r["step"] >= 3 for r in _records(out, w)) for w in ("A", "B"))),
            "A and B at step 3", 240)
        assert wait_until(lambda: check(lambda: cs.has(Keys.ready("stranger"))),
                          "the stranger to register", 240)

        os.kill(a.proc.pid, signal.SIGSTOP)
        wait_until(lambda: proc_state(a.proc.pid) == "T", "A to stop", 30)
        # What the driver does when it evicts A: abort round 1, publish round 2 without A.
        cs.put(Keys.abort(1), {"round": 1})
        publish_round(cs, 2, ["B"])

        wait_until(lambda: check(lambda: any(r["round"] == 2 and r["step"] >= 8
                                             for r in _records(out, "B"))),
                   "B to train on alone in round 2", 240)
        assert proc_state(a.proc.pid) == "T"
        assert b.stderr().count("restoring the last commit") == 1, b.stderr()

        os.kill(a.proc.pid, signal.SIGCONT)
        a.proc.wait(120)
        assert a.proc.returncode == 0, a.stderr()
        assert "not a member of round 2" in a.stderr(), a.stderr()
        assert all(r["round"] == 1 for r in _records(out, "A")), _records(out, "A")
        # A left without disturbing B: no new failure, B still in round 2.
        alive_or_fail(b)
        assert b.stderr().count("restoring the last commit") == 1, b.stderr()
        assert "failed" not in b.stderr().split("restoring the last commit", 1)[1], b.stderr()

        (out / "go.8").write_text("go")
        b.proc.wait(240)
        assert b.proc.returncode == 0, b.stderr()
        final = json.loads((out / "final.0.json").read_text())
        assert final["worker"] == "B" and final["size"] == 1
        assert not (out / "final.1.json").exists()
        assert_exactly_once(json.loads((out / "history.json").read_text()), 3, 48)
        records = _records(out, "A") + _records(out, "B")
        assert_memberships(records)
        assert {r["size"] for r in records if r["round"] == 2} == {1}

        # Nobody but the planned members ever joined a round.
        assert cs.has(Keys.joined(1, "A")) and cs.has(Keys.joined(1, "B"))
        assert cs.has(Keys.joined(2, "B")) and not cs.present(Keys.joined(2, "A"))
        assert not any(cs.present(Keys.joined(r, "stranger")) for r in (1, 2))
        alive_or_fail(stranger)
        assert _records(out, "stranger") == []
        assert "not a member" not in stranger.stderr()
    finally:
        for w in workers.values():
            if proc_state(w.proc.pid) == "T":
                os.kill(w.proc.pid, signal.SIGCONT)
            w.kill()
