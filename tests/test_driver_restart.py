"""Joining mode outlives its driver (issue 27): real driver, agents and workers on loopback.

The serving driver is SIGKILLed; its agents keep their workers, which train on in
the current round; the same `elasticrun --serve` command, started again at the
same port with the same secret, adopts them (same processes) and the job ends
exit 0 with bitwise-equal ranks, exactly-once samples and no committed step lost.
"""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from support.adversary import Outsider
from support.jobs import REPO
from support.procs import alive, job_workers
from support.waits import wait_until

from elastic.checkpoint.format import blob_checks, blob_path, list_checkpoints, read_manifest


def _adopted(out):
    """How many live workers the restarted drivers adopted (agents come back one by one)."""
    return sum(int(n) for n in re.findall(r"adopting (\d+) live worker", out))


def _kill_driver(job):
    job.proc.send_signal(signal.SIGKILL)
    job.proc.wait()
    job.close_log()


def _impostor(job, dump):
    """A process without the secret on the lost driver's port, replaying what an
    outsider recorded from the real store and forging a newer round, a stop and
    answers to registrations (tests/support/impostor_store.py)."""
    path = job.dir / "recorded.json"
    path.write_text(json.dumps(dump))
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "support" / "impostor_store.py"),
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
    # Rank 0 stays on its worker even when that worker's agent comes back last.
    rank0 = {(r["worker"], r["host"]) for r in job.steps() if r["rank"] == 0}
    assert len(rank0) == 1, rank0
    (rank0_worker, rank0_host), = rank0
    job.signal_agent(rank0_host, signal.SIGSTOP)
    earlier = len(job.output())
    job.restart_driver()
    try:
        job.wait_for(lambda: "waiting up to 10 s (--worker-timeout) for the agent of worker(s) "
                     f"{rank0_worker}" in job.output()[earlier:], "the driver to wait for it")
    finally:
        job.signal_agent(rank0_host, signal.SIGCONT)
    job.wait_for(lambda: any(e["event"] == "round_assembled" and e["round"] > before
                             for e in map(json.loads, events.read_text().splitlines())),
                 "the adopted round")      # the workers hold at step 9 until it formed
    job.release(9)
    code = job.finish()
    job.assert_ok(code, final_size=2)
    out = job.output()
    assert _adopted(out) == 2, out[-4000:]
    # The same two processes ran the whole job: no worker was started again.
    assert {r["worker"] for r in job.steps()} == {"0", "1"}
    assert {r["worker"] for r in job.steps() if r["rank"] == 0} == {rank0_worker}
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
def test_a_worker_that_crashes_while_the_driver_is_away_is_handled_when_it_returns(join_job, tmp_path):
    """The survivors restore the last commit and wait; the restarted driver adopts them and
    blames the crash (its agent reports the exit code no driver read): the host is
    blacklisted as for any failed worker, so the free slot is filled on a new host, by a
    worker whose id no earlier worker had, and the job ends with every sample trained once."""
    events = tmp_path / "events.jsonl"
    job = join_job(["-np", "3", "--min-np", "2", "--worker-timeout", "10",
                    "--event-log", str(events)],
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
    crashed = (job.out / "fault.0").read_text()
    host = next(r["host"] for r in job.steps() if r["worker"] == crashed)
    job.restart_driver()
    job.wait_for(lambda: "adopted worker(s) are back" in job.output(), "the adoption")
    job.wait_step(12, size=2)                 # held there until the newcomer's round
    job.join("node-d")                        # the slot the blacklisted host no longer gives
    job.wait_step(13, size=3)
    code = job.finish()
    job.assert_ok(code, final_size=3)
    out = job.output()
    assert _adopted(out) == 2, out[-4000:]
    assert f"worker {crashed} on {host} exited with code 3 while the driver was away; " \
           f"blacklisting host {host}" in out, out[-4000:]
    failed = [e for e in _events(events) if e["event"] in ("worker_failed", "host_blacklisted")]
    assert [(e["event"], e["host"]) for e in failed] == [("worker_failed", host),
                                                         ("host_blacklisted", host)], failed
    assert survivors < pids
    workers = {r["worker"] for r in job.steps()}
    assert workers == {"0", "1", "2", "3"} and crashed in workers, workers   # "3": a new id
    assert {r["worker"] for r in job.steps() if r["step"] > 6} == {"0", "1", "2", "3"} - {crashed}
    assert {r["host"] for r in job.steps() if r["worker"] == "3"} == {"node-d"}


@pytest.mark.slow
@pytest.mark.parametrize("checkpoints", [False, True], ids=["no-checkpoint-dir", "checkpoint-dir"])
def test_a_driver_killed_after_training_ended_is_told_the_job_finished(
        join_job, tmp_path, checkpoints):
    """Every worker wrote its final state and holds before exiting (JOB_END_GATE) when the
    driver is SIGKILLed; they exit 0 while it is away. The same command started again
    learns from --state-dir (the round, its members) and from the agents (their workers'
    exit codes, unread by any driver) that the job finished: it says so in one line and
    exits 0, starting no worker (without a checkpoint, starting one would train again
    from step 0). Started once more, it finds the job finished in --state-dir."""
    events, state = tmp_path / "events.jsonl", tmp_path / "state"
    extra = ["--checkpoint-dir", str(tmp_path / "ckpt")] if checkpoints else []
    job = join_job(["-np", "2", "--worker-timeout", "10", "--event-log", str(events),
                    "--state-dir", str(state)] + extra,
                   env={"JOB_END_GATE": "1", "JOB_EPOCHS": "1", "JOB_SAMPLES": "16"}).start()
    job.join("node-a")
    job.join("node-b")
    job.wait_for(lambda: len(job.finals()) == 2, "both workers' final state")
    pids = set(job_workers(job.out))
    _kill_driver(job)
    assert "job finished" not in job.output()
    (job.out / "end-go").write_text("go")
    wait_until(lambda: not job_workers(job.out), "the workers to exit while the driver is away",
               output=lambda: job.agent_output("node-a"))
    steps = len(job.steps())
    job.restart_driver()
    code = job.finish()
    out = job.output()
    assert code == 0, out[-4000:]
    assert "training finished while the driver was away: the 2 worker(s) of round" in out, \
        out[-4000:]
    assert "adopting" not in out and len(job.steps()) == steps     # nothing started again
    assert len(list(job.out.glob("env.*.json"))) == 2 and len(pids) == 2
    finished = [e for e in _events(events) if e["event"] == "job_finished"]
    assert [e.get("driver_away") for e in finished] == [True], finished
    for name in ("node-a", "node-b"):
        assert job.wait_agent(name) == 0, job.agent_output(name)
    job.restart_driver()                          # the job is over: it knows from --state-dir
    assert job.finish() == 0
    assert "the job in --state-dir already finished" in job.output().split(out)[-1]


@pytest.mark.slow
def test_a_driver_that_comes_back_to_no_surviving_worker_never_restarts_from_step_0(
        join_job, tmp_path):
    """Commits were made, then the driver and every worker died (SIGKILL): the restarted
    driver learns from --state-dir that work existed and from the agents that no worker
    survives (their exit codes are not 0). Without a checkpoint it follows the holders
    rule: one line naming the last commit, a non-zero exit, no worker started."""
    state = tmp_path / "state"
    job = join_job(["-np", "2", "--worker-timeout", "10", "--state-dir", str(state)],
                   env={"JOB_HOLD": "3"}).start()
    job.join("node-a")
    job.join("node-b")
    job.wait_step(3, size=2)

    def kept_commit():
        path = state / "driver-state.json"
        return json.loads(path.read_text()).get("commit", -1) if path.exists() else -1
    job.wait_for(lambda: kept_commit() >= 1, "a commit kept in --state-dir")
    _kill_driver(job)
    for pid in job_workers(job.out):
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not job_workers(job.out), "every worker to die",
               output=lambda: job.agent_output("node-a"))
    job.restart_driver()
    assert job.finish() == 1
    out = job.output()
    line = re.findall(r"elasticrun: error: (no surviving worker holds the training state; "
                      r"the last commit was (\d+))", out)
    assert line and int(line[-1][1]) == kept_commit() >= 1, out[-4000:]
    assert len(list(job.out.glob("env.*.json"))) == 2           # nothing started again
    assert "round 2" not in out and "adopting" not in out, out[-4000:]


def _events(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _no_step_went_back(records):
    """Per worker, in the order they ran: a step may repeat (retried, never committed),
    never go back (a committed step lost)."""
    by_worker = {}
    for r in sorted(records, key=lambda r: r["t"]):
        by_worker.setdefault(r["worker"], []).append(r["step"])
    for worker, steps in by_worker.items():
        assert steps == sorted(steps), (worker, steps)


@pytest.mark.slow
def test_a_driver_killed_mid_assembly_mid_sync_and_mid_checkpoint_write_loses_nothing(
        join_job, tmp_path):
    """One job, the driver SIGKILLed three times at the worst moments, each found by a
    condition, and started again each time: (1) while a round is being formed (it is
    published, a newcomer waits in it, the others are held at a gate before their
    commit); (2) while that newcomer receives the state in the adopted round's sync
    (stopped inside it by JOB_SYNC_GATE); (3) while rank 0 writes a checkpoint (a
    manifest's temp file is there). Before the last restart one agent is stopped
    (SIGSTOP, as a partition would cut it off) until the new driver says it waits for
    it: it is adopted with its worker too. At the end: exit 0, bitwise-equal ranks,
    exactly-once samples, no step gone back, the same three processes and worker ids
    throughout, and the checkpoints intact."""
    events, state, ckpt = tmp_path / "events.jsonl", tmp_path / "state", tmp_path / "ckpt"
    job = join_job(["-np", "2", "--max-np", "3", "--worker-timeout", "20",
                    "--event-log", str(events), "--state-dir", str(state),
                    "--checkpoint-dir", str(ckpt)],
                   env={"JOB_GATE": "3", "JOB_HOLD": "6,10,14", "JOB_EPOCHS": "4",
                        "JOB_SYNC_GATE": "node-c",
                        "ELASTIC_CHECKPOINT_TEST_DELAY": "0.3"}).start()
    job.join("node-a")
    job.join("node-b")
    job.wait_step(3, size=2)                  # both held at the gate, before their commit
    first = max(r["round"] for r in job.steps())
    job.join("node-c")

    def started(after):
        return [e["round"] for e in _events(events)
                if e["event"] == "round_started" and e["round"] > after]

    def assembled(round_id):
        return any(e["event"] == "round_assembled" and e["round"] >= round_id
                   for e in _events(events))
    job.wait_for(lambda: started(first), "the round with the newcomer to be published")
    forming = started(first)[0]
    job.wait_for(lambda: len(job_workers(job.out)) == 3, "the newcomer to start")
    _kill_driver(job)                                           # (1) mid-assembly
    assert not assembled(forming)
    pids = set(job_workers(job.out))
    (job.out / "gate").write_text("go")
    wait_until(lambda: any(r["step"] >= 6 for r in job.steps()), "training on to step 6",
               output=lambda: job.agent_output("node-a"))
    assert {r["round"] for r in job.steps()} == {first}         # on in the old round
    job.restart_driver()
    wait_until(lambda: list(job.out.glob("syncing.*")), "the newcomer inside its sync",
               output=job.output)
    _kill_driver(job)                                           # (2) mid-sync
    (job.out / "sync-go").write_text("go")
    job.release(6)               # (a round change ends a hold: the steps go on to the next)
    wait_until(lambda: any(r["step"] >= 10 and r["size"] == 3 for r in job.steps()),
               "three workers training on to step 10", output=lambda: job.agent_output("node-c"))
    adopted = {r["round"] for r in job.steps() if r["size"] == 3}
    job.restart_driver()
    job.wait_for(lambda: assembled(max(adopted) + 1), "the next adopted round")
    job.wait_step(14, size=3)             # held there, committing: checkpoints are written
    wait_until(lambda: list(ckpt.rglob("*.tmp")), "rank 0 writing a checkpoint",
               output=job.output)
    _kill_driver(job)                                           # (3) mid-checkpoint write
    earlier = len(job.output())     # the earlier drivers' lines may say the same words

    def newest_driver():
        return job.output()[earlier:]
    job.signal_agent("node-b", signal.SIGSTOP)                  # cut off, its worker not
    job.restart_driver()
    try:
        job.wait_for(lambda: "waiting up to 20 s (--worker-timeout) for the agent of "
                     "worker(s)" in newest_driver(), "the driver to wait for node-b")
    finally:
        job.signal_agent("node-b", signal.SIGCONT)
    job.wait_for(lambda: "3 adopted worker(s) are back" in newest_driver().split(
        "waiting up to")[-1], "node-b's worker adopted too")
    job.release(14)
    code = job.finish()
    job.assert_ok(code, epochs=4, final_size=3)
    out = job.output()
    assert _adopted(out) == 9 and "did not come back with" not in out, out[-4000:]
    assert len(list(job.out.glob("env.*.json"))) == 3           # no worker started again
    assert {r["worker"] for r in job.steps()} == {"0", "1", "2"}
    assert not job_workers(job.out) and len(pids) == 3         # and no orphan left
    _no_step_went_back(job.steps())
    rounds = [e["round"] for e in _events(events) if e["event"] == "round_started"]
    assert rounds == sorted(set(rounds)), rounds               # rising, never reused
    assert not list(ckpt.rglob("*.tmp"))                       # every write completed
    written = list_checkpoints(str(ckpt))
    assert written
    for _, manifest in written:                                # each verifies, blob by blob
        body = read_manifest(manifest)
        for name, size in body["blobs"].items():
            data = open(blob_path(str(ckpt), name), "rb").read()
            assert len(data) == size and blob_checks(name, data), manifest
    for name in ("node-a", "node-b", "node-c"):
        assert job.wait_agent(name) == 0, job.agent_output(name)
