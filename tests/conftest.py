"""Every test starts outside elasticrun: a standalone runtime of size 1.

Tests that need a job start real processes; nothing here leaks a worker
identity into the test process itself.
"""

import pytest

from elastic.protocol import ENV_ADDR
from elastic.worker import runtime


@pytest.fixture(autouse=True)
def standalone(monkeypatch):
    monkeypatch.delenv(ENV_ADDR, raising=False)
    runtime.shutdown()
    yield
    runtime.shutdown()
