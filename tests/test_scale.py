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
