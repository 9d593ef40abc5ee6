"""Every test starts outside elasticrun: a standalone runtime of size 1.

Tests that need a job start real processes; nothing here leaks a worker
identity into the test process itself, and no failed test leaves a job running.
"""

import pytest
from jobs import Job, kill_leftover_jobs

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
