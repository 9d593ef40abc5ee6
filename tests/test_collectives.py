"""The collectives of the public API (README, "Python API") on two real gloo processes,
and at size 1."""

import json

import pytest
import torch
from support.harness import REPO, run_workers

import elastic

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks():
    results = run_workers(REPO / "tests" / "workloads" / "collectives_check.py", 2, timeout=180)
    by_rank = {}
    for r in results:
        line = [x for x in r.stdout.splitlines() if x.startswith("{")]
        assert line, r.stdout + r.stderr
        data = json.loads(line[-1])
        by_rank[data["rank"]] = data
    assert set(by_rank) == {0, 1}
    return by_rank


def test_reductions_gathers_and_broadcasts(ranks):
    for r in (0, 1):
        d = ranks[r]
        assert d["size"] == 2
        assert d["allreduce_avg"] == [1.5]
        assert d["allreduce_sum"] == [3]
        assert d["allgather"] == [0, 0, 1]
        assert d["broadcast"] == [10.0]
        assert d["broadcast_object"] == {"from": 1}
        assert d["allgather_object"] == ["r0", "r1"]


def test_broadcast_parameters_and_optimizer_state(ranks):
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[1]["opt_state"] == ranks[0]["opt_state"] and ranks[0]["opt_state"]


def test_a_departed_peer_raises_workers_departed_error(ranks):
    assert ranks[0]["departed"] == "WorkersDepartedError"


def test_size_one_outside_elasticrun():
    elastic.init()
    assert (elastic.rank(), elastic.size(), elastic.local_rank(), elastic.cross_size()) == \
        (0, 1, 0, 1)
    t = torch.tensor([2.0, 3.0])
    assert torch.equal(elastic.allreduce(t), t) and torch.equal(elastic.allgather(t), t)
    assert elastic.broadcast_object("x") == "x" and elastic.allgather_object(1) == [1]
    elastic.barrier()
