"""Every test starts outside elasticrun: a standalone runtime of size 1.

Tests that need a job start real processes; nothing here leaks a worker
identity into the test process itself, and no failed test leaves a job running.
"""

import pytest
from support.jobs import Job, kill_leftover_jobs
from support.join_cluster import JoinJob

from elastic.protocol import ENV_ADDR
from elastic.worker import runtime


@pytest.fixture(autouse=True)
def standalone(monkeypatch):
    monkeypatch.delenv(ENV_ADDR, raising=False)
    runtime.shutdown()
    yield
    runtime.shutdown()


@pytest.fixture(autouse=True)
def no_job_left_behind(monkeypatch):
    """A test that fails mid-job must not leave its elasticrun (and workers) running."""
    started = []
    start = Job.start

    def tracked(self):
        started.append(self)
        return start(self)

    monkeypatch.setattr(Job, "start", tracked)
    yield
    kill_leftover_jobs(started)


@pytest.fixture
def join_job(tmp_path):
    """Makes joining-mode jobs (join_cluster.JoinJob: a serving driver and its agents),
    each cleaned up after the test (tests/test_join.py, tests/test_driver_restart.py)."""
    jobs = []

    def make(args, env=None, **kw):
        job = JoinJob(tmp_path, args, env=env, **kw)
        jobs.append(job)
        return job
    yield make
    for job in jobs:
        job.cleanup()
