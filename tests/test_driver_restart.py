"""Joining mode outlives its driver (issue 27): real driver, agents and workers on loopback.

The serving driver is SIGKILLed; its agents keep their workers, which train on in
the current round; the same `elasticrun --serve` command, started again at the
same port with the same secret, adopts them (same processes) and the job ends
exit 0 with bitwise-equal ranks, exactly-once samples and no committed step lost.
"""

import json
import signal
import subprocess
import sys

import pytest
from adversary import Outsider
from jobs import REPO
from join_cluster import wait_until
from procs import alive, job_workers


def _kill_driver(job):
    job.proc.send_signal(signal.SIGKILL)
    job.proc.wait()
    job.close_log()


def _impostor(job, dump):
    """A process without the secret on the lost driver's port, replaying what an
    outsider recorded from the real store and forging a newer round, a stop and
    answers to registrations (tests/impostor_store.py)."""
    path = job.dir / "recorded.json"
    path.write_text(json.dumps(dump))
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "impostor_store.py"),
                             str(job.port), str(path)], env=job.env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout.readline().strip() == "listening"
    return proc


def _registrations_at(port):
    """The agent registrations (with their live workers) written to the store at ``port``."""
    store = Outsider("127.0.0.1", port)
    try:
        return [k for k in store.keys() if k.endswith("/info")
                and "workers" in (store.payload(k) or {})]
    finally:
        store.close()


@pytest.mark.slow
def test_a_sigkilled_driver_restarted_adopts_the_live_workers(join_job, tmp_path):
    """Also trust: while the driver is away, an impostor holds its port (replaying the
    real store's values, hello included, and forging others): every agent and worker
    ignores it; then the real driver comes back and adopts the job."""
    events, state = tmp_path / "events.jsonl", tmp_path / "state"
    job = join_job(["-np", "2", "--worker-timeout", "10", "--event-log", str(events),
                    "--state-dir", str(state)], env={"JOB_HOLD": "3,9"}).start()
    job.join("node-a")
    job.join("node-b")
    job.wait_step(3, size=2)
    pids = set(job_workers(job.out))
    assert len(pids) == 2
    assert json.loads((state / "driver-state.json").read_text())["next_worker"] == 2
    before = max(r["round"] for r in job.steps())
    spy = Outsider("127.0.0.1", job.port)
    recorded = {k: spy.get(k).hex() for k in spy.keys() if spy.get(k) is not None}
    spy.close()
    _kill_driver(job)
    impostor = _impostor(job, recorded)
    try:
        # Nothing needs the driver while the round stays: the workers train on without it.
        job.release(3)
        wait_until(lambda: any(r["step"] >= 9 for r in job.steps()), "training on to step 9",
                   output=lambda: job.agent_output("node-a"))
        wait_until(lambda: len(_registrations_at(job.port)) == 2,
                   "both agents to try the impostor", output=lambda: job.agent_output("node-a"))
    finally:
        impostor.kill()
        impostor.wait()
    assert {r["round"] for r in job.steps() if r["step"] > 3} == {before}   # no forged round
    assert set(job_workers(job.out)) == pids                              # nor a forged stop
    for name in ("node-a", "node-b"):
        text = job.agent_output(name)
        assert "does not answer; keeping 1 worker(s)" in text
        assert "answers again;" not in text, text[-3000:]
    job.restart_driver()
    job.wait_for(lambda: any(e["event"] == "round_assembled" and e["round"] > before
                             for e in map(json.loads, events.read_text().splitlines())),
                 "the adopted round")      # the workers hold at step 9 until it formed
    job.release(9)
    code = job.finish()
    job.assert_ok(code, final_size=2)
    out = job.output()
    assert "adopting 2 live worker(s)" in out, out[-4000:]
    # The same two processes ran the whole job: no worker was started again.
    assert {r["worker"] for r in job.steps()} == {"0", "1"}
    after = [r["round"] for r in job.steps() if r["step"] > 9]
    assert after and before < min(after) < 1000, (before, after)
    for name in ("node-a", "node-b"):
        assert job.wait_agent(name) == 0, job.agent_output(name)
        assert job.agent_output(name).count("answers again;") == 1
    assert not any(alive(p) for p in pids)
    # The event log of both drivers, appended; the state file follows the new rounds.
    kinds = [json.loads(line)["event"] for line in events.read_text().splitlines()]
    assert kinds.count("round_started") == 2 and kinds.count("worker_adopted") == 2, kinds
    assert json.loads((state / "driver-state.json").read_text())["round"] == max(after)
    assert "took back round" in out


@pytest.mark.slow
def test_a_worker_that_crashes_while_the_driver_is_away_is_handled_when_it_returns(join_job):
    """The survivors restore the last commit and wait; the restarted driver adopts them,
    fills the free slot with a worker whose id no earlier worker had, and the job ends
    with every sample trained once."""
    job = join_job(["-np", "3", "--min-np", "2", "--worker-timeout", "10"],
                   env={"JOB_HOLD": "3,12", "JOB_FAULT": "6:2:exit"}).start()
    for name in ("node-a", "node-b", "node-c"):
        job.join(name)
    job.wait_step(3, size=3)
    pids = set(job_workers(job.out))
    _kill_driver(job)
    job.release(3)
    wait_until(lambda: (job.out / "fault.0").exists() and len(job_workers(job.out)) == 2,
               "rank 2 to crash while the driver is away", output=lambda: job.agent_output("node-a"))
    survivors = set(job_workers(job.out))
    wait_until(lambda: sum("restoring the last commit" in job.agent_output(n)
                           for n in ("node-a", "node-b", "node-c")) == 2,
               "the survivors to restore the last commit",
               output=lambda: job.agent_output("node-a"))
    job.restart_driver()
    job.wait_for(lambda: "adopted worker(s) are back" in job.output(), "the adoption")
    job.release(12)
    code = job.finish()
    job.assert_ok(code, final_size=3)
    out = job.output()
    assert "adopting 2 live worker(s)" in out, out[-4000:]
    assert survivors < pids
    crashed = (job.out / "fault.0").read_text()
    workers = {r["worker"] for r in job.steps()}
    assert workers == {"0", "1", "2", "3"} and crashed in workers, workers   # "3": a new id
    assert {r["worker"] for r in job.steps() if r["step"] > 6} == {"0", "1", "2", "3"} - {crashed}


