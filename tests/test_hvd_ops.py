"""Horovod's PyTorch op behaviours on real gloo, under elasticrun with 2 and 3 workers.

One job per world size runs every check of tests/workloads/hvd_ops_suite.py
(torch is imported once per worker); each test here asserts one check on
every rank.
"""

import json
import sys

import pytest
from support.jobs import REPO, Job

sys.path.insert(0, str(REPO / "tests" / "workloads"))
import hvd_ops_suite  # noqa: E402

pytestmark = pytest.mark.slow
SCRIPT = REPO / "tests" / "workloads" / "hvd_ops_suite.py"


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def suite(request, tmp_path_factory):
    n = request.param
    job = Job(tmp_path_factory.mktemp(f"ops{n}"), ["-np", str(n), "-H", f"localhost:{n}"],
              env={"ELASTIC_COLLECTIVE_TIMEOUT": "60", "HVD_OPS_SIZE": str(n)}, script=SCRIPT)
    code = job.run(timeout=400)
    per_rank = {}
    for path in sorted(job.out.glob("ops.*.json")):
        data = json.loads(path.read_text())
        per_rank[int(path.name.split(".")[1])] = data
    return {"n": n, "code": code, "log": job.output(), "ranks": per_rank}


def test_job_ran_every_check_on_every_rank(suite):
    assert suite["code"] == 0, suite["log"][-4000:]
    assert sorted(suite["ranks"]) == list(range(suite["n"])), suite["log"][-4000:]
    for data in suite["ranks"].values():
        assert data["size"] == suite["n"]
        assert set(data["results"]) == set(hvd_ops_suite.CHECKS)


@pytest.mark.parametrize("check", sorted(hvd_ops_suite.CHECKS))
def test_op_behaviour(suite, check):
    assert suite["ranks"], suite["log"][-4000:]
    for rank, data in sorted(suite["ranks"].items()):
        result = data["results"].get(check)
        assert result is not None, f"rank {rank} never reached {check}:\n{suite['log'][-3000:]}"
        assert result["ok"], f"rank {rank}: {result['error']}\n{result['trace']}"


def test_process_sets_across_a_membership_change(tmp_path):
    """Ranks-defined sets raise ProcessSetStaleError after a change; re-added and
    rule-defined sets work with the new members. A DistributedOptimizer over a ranks-defined
    set averages its members and, after the change, raises ProcessSetStaleError on every rank;
    re-adding the set object in a reset callback makes it usable again."""
    job = Job(tmp_path, ["-np", "3", "--min-np", "2", "-H", "localhost:2,127.0.0.1:1"],
              script=REPO / "tests" / "workloads" / "hvd_process_sets_elastic.py")
    assert job.run() == 0, job.output()[-4000:]
    records = [json.loads(line) for p in job.out.glob("ps.*.jsonl")
               for line in p.read_text().splitlines()]
    before = [r for r in records if r["size"] == 3]
    after = [r for r in records if r["size"] == 2]
    assert before and after, records
    for r in before:
        assert r["ruled_ranks"] == [0, 2]
        assert r["readded"] == 1 + 2 + 3, r
        if r["rank"] in (0, 1):
            assert r["stale"] == 3, r
        if r["rank"] in (0, 2):
            assert r["ruled"] == 1 + 3, r
        assert r["opt"] == (1.5 if r["rank"] in (0, 1) else 3.0), r
        assert r["opt_again"] == r["rank"] + 1, r
    for r in after:
        assert r["ruled_ranks"] == [0, 1]
        assert r["stale"] == "ProcessSetStaleError", r
        assert r["readded"] == 3 and r["ruled"] == 3, r
        assert r["opt"] == "ProcessSetStaleError" and r["opt_again"] == r["rank"] + 1, r
    assert {r["rank"] for r in after} == {0, 1}
    # the survivors learnt of the departure inside an elastic.torch op, as WorkersDepartedError
    assert sorted(p.read_text() for p in job.out.glob("departed.*")) == ["0", "1"]
