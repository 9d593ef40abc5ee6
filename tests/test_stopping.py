"""Stopping is not failing (issue 10): SIGTERM/SIGINT to elasticrun stops every
worker at the same commit; SIGTERM to one worker is a graceful leave.

Real elasticrun jobs, real signals. Waits poll a condition under a generous
deadline; nothing sleeps a fixed time to let something happen.
"""

import json
import os
import re
import signal
import socket

import pytest
from support.jobs import Job, assert_exactly_once, sizes_in_order
from support.procs import assert_no_worker_left, job_workers, pid_of
from support.waits import wait_until

pytestmark = pytest.mark.slow

HOST3 = socket.gethostname() if socket.gethostname() not in ("localhost", "127.0.0.1") \
    else socket.getfqdn()


def events(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def worker_on(job, host):
    """The worker id of the live worker on ``host``."""
    def find():
        return next((env["ELASTIC_WORKER_ID"] for env in job_workers(job.out).values()
                     if env.get("ELASTIC_HOSTNAME") == host), None)
    return wait_until(find, f"a worker on {host}", 60)


# -- 1. graceful stop of the whole job ---------------------------------------------------------
@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_driver_signal_stops_every_worker_at_one_commit_and_a_rerun_loses_nothing(
        tmp_path, signum, code):
    ckpt = tmp_path / "ckpt"
    args = ["-np", "2", "-H", "localhost:2", "--checkpoint-dir", str(ckpt)]
    # The rerun must find the stop's own checkpoint (a periodic one would be older).
    env = {"JOB_EPOCHS": "6"}
    job = Job(tmp_path / "first", args, env=env).start()
    job.wait_step(10)
    os.kill(job.proc.pid, signum)
    assert job.finish(timeout=120) == code, job.output()[-3000:]
    out = job.output()
    assert f"stopped by signal {int(signum)}: every worker stopped" in out, out[-3000:]
    stops = re.findall(r"elasticrun is stopping; stopped at commit (\d+)", out)
    assert len(stops) == 2 and len(set(stops)) == 1, out[-3000:]      # both, at one commit
    assert "did not stop" not in out and "blacklisting" not in out
    assert not job.finals()                 # the job did not finish: nothing after train()
    assert_no_worker_left(job)
    stopped_at = int(stops[0])
    trained = max(r["step"] for r in job.steps())

    rerun = Job(tmp_path / "second", args, env=env)
    rerun.assert_ok(rerun.run(), epochs=6)
    resumed = re.findall(r"resumed from checkpoint \S+ \(commit (\d+)\)", rerun.output())
    assert resumed and int(resumed[0]) == stopped_at, rerun.output()[-3000:]
    history = rerun.history()
    assert_exactly_once(history, 6, 48)     # no committed step lost, none trained twice
    first_new = min(r["step"] for r in rerun.steps())
    assert first_new == trained + 1, (first_new, trained)   # every step before the stop kept


def test_stop_timeout_kills_workers_that_do_not_reach_a_commit_and_a_second_sigint_is_at_once(
        tmp_path):
    # Rank 1's training thread is stuck: it never reaches a commit.
    job = Job(tmp_path / "timeout", ["-np", "2", "-H", "localhost:2", "--stop-timeout", "2"],
              env={"JOB_FAULT": "4:1:stuck"}).start()
    job.wait_for((job.out / "fault.0").exists, "rank 1 to get stuck")
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.finish(timeout=120) == 143, job.output()[-3000:]
    assert "did not stop within --stop-timeout 2 s and were killed" in job.output()
    assert_no_worker_left(job)

    job = Job(tmp_path / "twice", ["-np", "2", "-H", "localhost:2", "--stop-timeout", "600"],
              env={"JOB_FAULT": "4:1:stuck"}).start()
    job.wait_for((job.out / "fault.0").exists, "rank 1 to get stuck")
    os.kill(job.proc.pid, signal.SIGINT)
    job.wait_for(lambda: "stopping; every worker finishes its step" in job.output(),
                 "the driver to start stopping")
    os.kill(job.proc.pid, signal.SIGINT)
    assert job.finish(timeout=60) == 130, job.output()[-3000:]
    assert_no_worker_left(job)


# -- 2. preemption drain: SIGTERM to one worker ---------------------------------------------------
def test_worker_sigterm_is_a_graceful_leave_and_discovery_brings_the_host_back(tmp_path):
    log = tmp_path / "events.jsonl"
    job = Job(tmp_path, ["-np", "3", "--min-np", "2", "--event-log", str(log)],
              hosts=["localhost:1", "127.0.0.1:1", f"{HOST3}:1"],
              env={"JOB_HOLD": "4,12", "JOB_EPOCHS": "4"}).start()
    job.wait_step(4, size=3)
    leaver = worker_on(job, "127.0.0.1")
    os.kill(pid_of(job.out, leaver), signal.SIGTERM)
    job.wait_step(6, size=2)
    out = job.output()
    assert f"worker {leaver} on 127.0.0.1 left at commit" in out, out[-3000:]
    assert "host 127.0.0.1 is preempted (not blacklisted)" in out
    assert "blacklisting" not in out and "restoring the last commit" not in out, out[-3000:]
    # Nothing moved to the survivors: what they received (at the job's start) stayed put.
    records = job.steps()
    for wid in {r["worker"] for r in records if r["size"] == 2}:
        assert len({r["received"] for r in records if r["worker"] == wid}) == 1, records
    kinds = [e["event"] for e in events(log)]
    assert "host_preempted" in kinds and "host_blacklisted" not in kinds, kinds
    # The machine goes away (discovery drops it) and comes back: it is used again.
    job.wait_step(12, size=2)
    job.set_hosts(["localhost:1", f"{HOST3}:1"])
    job.wait_for(lambda: "removed 127.0.0.1" in job.output(), "discovery to drop 127.0.0.1")
    job.set_hosts(["localhost:1", f"{HOST3}:1", "127.0.0.1:1"])
    job.wait_step(13, size=3)
    job.release(12)
    finals = job.assert_ok(job.finish(), epochs=4, final_size=3)
    assert leaver not in {f["worker"] for f in finals}
    assert sizes_in_order(job.steps())[:2] == [3, 2]


def test_worker_that_does_not_reach_a_commit_after_sigterm_counts_as_failed(tmp_path):
    job = Job(tmp_path, ["-np", "3", "--min-np", "2", "--stop-timeout", "2",
                         "-H", f"localhost:1,127.0.0.1:1,{HOST3}:1"],
              env={"JOB_FAULT": "4:1:stuck"}).start()
    job.wait_for((job.out / "fault.0").exists, "rank 1 to get stuck")
    stuck = (job.out / "fault.0").read_text()
    os.kill(pid_of(job.out, stuck), signal.SIGTERM)
    job.assert_ok(job.finish(), final_size=2)
    out = job.output()
    assert f"worker {stuck} on 127.0.0.1 did not reach a commit within --stop-timeout 2 s " \
           "after SIGTERM; evicted" in out, out[-3000:]
    assert "blacklisting host 127.0.0.1" in out


# -- 3. a SIGTERM that lands inside the commit's own collective ------------------------------------
LATE_SIGTERM_WORKER = '''
import json, os, signal, sys
import torch
import elastic
from elastic.exceptions import HostsUpdatedInterrupt, StopTraining
from elastic.protocol import Keys
from elastic.worker import runtime

w = runtime.ensure_joined()
state = elastic.ObjectState(step=0)
state.sync()
if elastic.rank() == 1:
    flags = w.commit_flags

    def flags_then_sigterm():
        said = flags()
        if state.step == 1:                 # after this rank's flags went out: peers
            os.kill(os.getpid(), signal.SIGTERM)   # cannot hear of it at this commit
        return said
    w.commit_flags = flags_then_sigterm
outcome = {"rank": elastic.rank()}
try:
    for step in (1, 2, 3):
        state.step = step
        state.commit()
        outcome["after"] = float(elastic.allreduce(torch.ones(1)))   # peers still here?
except HostsUpdatedInterrupt:
    outcome["interrupted_at"] = state.step
except StopTraining as exc:
    outcome["left_at"], outcome["said"] = state.step, str(exc)
    beat = lambda: (w.control.get(Keys.heartbeat(w.worker_id)) or {}).get("beat", 0)
    first = beat()
    while beat() < first + 3:               # the heartbeat keeps reporting the leave
        pass
with open(os.path.join(os.environ["OUT_DIR"], f"{elastic.rank()}.json"), "w") as f:
    json.dump(outcome, f)
'''


def test_a_sigterm_during_the_commit_collective_leaves_at_the_next_commit_with_its_number(
        tmp_path):
    """The rank's flags at a commit said "staying"; leaving there anyway would break its
    peers' next collective (they roll back). It leaves at the next commit, and the
    heartbeat's later reports keep the commit number the driver logs."""
    from support.harness import Workers

    from elastic.protocol import Keys
    script = tmp_path / "late_sigterm.py"
    script.write_text(LATE_SIGTERM_WORKER)
    with Workers(script, 2, tmp_path, extra_env={"OUT_DIR": str(tmp_path),
                                                  "ELASTIC_HEARTBEAT_INTERVAL": "0.05"},
                 timeout=120) as job:
        results = job.finish()
        assert [r.returncode for r in results] == [0, 0], job.logs()
        rank0, rank1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
        assert rank0 == {"rank": 0, "after": 1.0, "interrupted_at": 2}, (rank0, job.logs())
        assert rank1["after"] == 1.0 and rank1["left_at"] == 2, (rank1, job.logs())
        commit = int(re.search(r"left the job at commit (\d+)", rank1["said"]).group(1))
        assert job.control.get(Keys.leaving("w1")) == {"signal": 15, "commit": commit}
