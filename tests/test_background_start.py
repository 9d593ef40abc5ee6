"""A replacement started while the job trains without it sets up at SCHED_IDLE and is put
back to SCHED_OTHER once it is ready (elastic/runner/background_start.py)."""

import os
import re
import signal

import pytest
from support.jobs import Job, kill_leftover_jobs
from support.procs import job_workers, policies

from elastic.runner.background_start import IDLE_AT_MOST_S, restore_due, start_in_background
from elastic.runner.priority import may_return_from_idle


def test_only_a_job_that_trains_without_the_newcomer_starts_it_idle():
    assert start_in_background(ready_others=1, min_np=1)
    assert start_in_background(ready_others=3, min_np=2)
    assert not start_in_background(ready_others=1, min_np=2)   # the job waits for it
    assert not start_in_background(ready_others=0, min_np=0)   # the first round's workers


def test_an_idle_newcomer_is_put_back_when_ready_needed_or_late():
    assert not restore_due(1.0, ready=False, ready_others=2, min_np=2)
    assert restore_due(1.0, ready=True, ready_others=2, min_np=2)
    assert restore_due(1.0, ready=False, ready_others=1, min_np=2)   # a peer died meanwhile
    assert restore_due(IDLE_AT_MOST_S, ready=False, ready_others=2, min_np=2)


@pytest.fixture
def started():
    jobs = []
    yield jobs
    kill_leftover_jobs(jobs)


def test_a_replacement_sets_up_idle_and_trains_at_normal_priority(tmp_path, started):
    job = Job(tmp_path, ["-np", "2", "--min-np", "1", "--max-np", "2"],
              hosts=["localhost:1", "127.0.0.1:1", "127.0.0.2:1"],
              env={"JOB_HOLD": "3,6", "JOB_POLICY": "1"}).start()
    started.append(job)
    job.wait_step(3, size=2)
    first = job_workers(job.out)
    # The first round's workers: nothing trained yet, so they start at normal priority.
    for env in first.values():
        assert (job.out / f"policy.{env['ELASTIC_WORKER_ID']}").read_text() == \
            str(os.SCHED_OTHER)
    victim = next(pid for pid, e in first.items() if e["ELASTIC_HOSTNAME"] == "localhost")
    os.kill(victim, signal.SIGKILL)
    job.wait_for(lambda: len(set(job_workers(job.out)) - set(first)) == 1, "a replacement")
    (pid,) = set(job_workers(job.out)) - set(first)
    wid = job_workers(job.out)[pid]["ELASTIC_WORKER_ID"]
    job.wait_for(lambda: (job.out / f"policy.{wid}").exists(), "the replacement's policy")
    idle = os.SCHED_IDLE if may_return_from_idle() else os.SCHED_OTHER
    assert (job.out / f"policy.{wid}").read_text() == str(idle)
    # The survivor trains on alone to step 6 and holds there; the replacement joins it.
    job.wait_for(lambda: re.search(r"round \d+: 2 workers \(\+1", job.output()),
                 "the replacement to join")
    assert policies(pid) == {os.SCHED_OTHER}         # ready: every thread back to normal
    job.release(3)
    job.release(6)
    job.assert_ok(job.finish(), final_size=2)
    assert any(r["worker"] == wid for r in job.steps())
