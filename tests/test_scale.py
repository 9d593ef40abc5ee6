"""`make scale`'s harness, small: the real driver and 12 simulated workers through a
join, a leave and a crash (no timing is asserted; make scale prints the figures)."""

import pytest

from benchmarks import scale


@pytest.mark.slow
def test_the_simulated_cluster_goes_through_a_join_a_leave_and_a_crash():
    row = scale.measure(12, steady_s=1.0, timeout=120, processes=2)
    # Every change ended in an assembled round of the right size.
    assert row["rounds"] == [12, 13, 12, 11], row
    for change, size in (("join", 13), ("leave", 12), ("crash", 11)):
        joins = row[f"{change}_joins"]
        assert joins is not None and joins["workers"] == size, (change, joins)
        # Each member read something to join, one small key per look: a look never
        # reads anything like the whole plan (how many looks depends on the load).
        assert joins["bytes_median"] > 0 and joins["requests_median"] > 0, (change, joins)
        per_look = joins["bytes_median"] / joins["requests_median"]
        assert per_look < row["plan_bytes_before"] / 2, (change, joins, row["plan_bytes_before"])
    assert row["store_rps"] > 0 and row["driver_cpu"] > 0


@pytest.mark.slow
def test_members_of_a_big_round_read_only_their_own_entry(monkeypatch, tmp_path):
    """Above SELF_ASSEMBLY_MAX a member's entry carries the round's size: members join
    the rounds of a join, a leave and a crash without reading their headers. Only a
    worker with no entry reads one: the newcomer asks whether it is in round 1, the
    removed worker whether it is in the leave's round (it is not: it leaves)."""
    import os

    from elastic.control_store import ControlStore
    from elastic.protocol import Keys
    from elastic.worker import runtime

    monkeypatch.setattr(runtime, "SELF_ASSEMBLY_MAX", 4)     # 12 workers: a big round
    reads = tmp_path / "header-reads"
    real_get = ControlStore.get
    headers = {Keys.plan(r) for r in range(2, 20)}

    def get(self, key):
        if key in headers:                 # the forked processes inherit this patch
            with open(reads, "a") as f:
                f.write(f"{os.getpid()} {key}\n")
        return real_get(self, key)

    monkeypatch.setattr(ControlStore, "get", get)
    row = scale.measure(12, steady_s=1.0, timeout=120, processes=2)
    assert row["rounds"] == [12, 13, 12, 11], row
    read = reads.read_text().split() if reads.exists() else []
    keys = read[1::2]
    # Rounds 2, 3, 4: the join's, the leave's and the crash's.
    assert keys.count(Keys.plan(2)) == 0 and keys.count(Keys.plan(4)) == 0, read
    assert keys.count(Keys.plan(3)) <= 1, read
    assert len(keys) == keys.count(Keys.plan(3)), read
