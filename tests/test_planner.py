"""Unit tests of the round planner (elastic/runner/planner.py): pure functions, no processes."""

import dataclasses

import pytest

from elastic.protocol import Member
from elastic.runner.planner import (
    Candidate,
    assign,
    describe_change,
    order_hosts,
    plan_round,
    same_membership,
)


def cands(*specs):
    """cands("a:0", "a:1", "b:0") -> Candidates with worker ids "a0", "a1", "b0"."""
    out = []
    for spec in specs:
        host, slot = spec.rsplit(":", 1)
        out.append(Candidate(f"{host}{slot}", host, int(slot)))
    return out


def ids(members):
    return [m.worker_id for m in members]


def by_id(members):
    return {m.worker_id: m for m in members}


# -- Candidate ----------------------------------------------------------------------------

def test_candidate_is_frozen_and_hashable():
    c = Candidate("0", "a", 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.slot = 1
    assert {c, Candidate("0", "a", 0)} == {c}


# -- order_hosts --------------------------------------------------------------------------

@pytest.mark.parametrize("host_order,hosts,expected", [
    ([], ["a", "b"], ["a", "b"]),                          # nothing seen yet: discovery order
    (["b", "a"], ["a", "b"], ["b", "a"]),                  # survivors keep their order
    (["b", "a"], ["c", "a", "b"], ["b", "a", "c"]),        # new host goes last
    (["a", "b", "c"], ["c", "a"], ["a", "c"]),             # departed host drops out, order kept
    (["a", "b"], ["d", "c", "b"], ["b", "d", "c"]),        # several new hosts: their own order
    (["a"], [], []),
])
def test_order_hosts(host_order, hosts, expected):
    assert order_hosts(host_order, hosts) == expected


def test_order_hosts_does_not_mutate_its_inputs():
    host_order, hosts = ["b", "a"], ["a", "c", "b"]
    order_hosts(host_order, hosts)
    assert host_order == ["b", "a"] and hosts == ["a", "c", "b"]


# -- plan_round: rank order ----------------------------------------------------------------

def test_first_round_follows_candidate_host_order_then_slot():
    members = plan_round(cands("a:0", "a:1", "b:0", "b:1"), [])
    assert ids(members) == ["a0", "a1", "b0", "b1"]
    assert [m.rank for m in members] == [0, 1, 2, 3]
    assert all(m.size == 4 for m in members)


def test_rank_order_within_a_host_is_by_slot_not_by_candidate_order():
    members = plan_round(cands("a:2", "b:1", "a:0", "b:0", "a:1"), ["a", "b"])
    assert ids(members) == ["a0", "a1", "a2", "b0", "b1"]


def test_survivors_keep_their_host_order_whatever_the_candidate_order():
    # b joined first, so it keeps rank 0 even when candidates list a first.
    members = plan_round(cands("a:0", "a:1", "b:0", "b:1"), ["b", "a"])
    assert ids(members) == ["b0", "b1", "a0", "a1"]


def test_new_hosts_go_last():
    members = plan_round(cands("new:0", "a:0", "new:1", "b:0"), ["a", "b"])
    assert ids(members) == ["a0", "b0", "new0", "new1"]


def test_several_new_hosts_go_last_in_candidate_order():
    members = plan_round(cands("y:0", "a:0", "x:0"), ["a"])
    assert ids(members) == ["a0", "y0", "x0"]


def test_rank0_is_slot0_of_the_oldest_surviving_host():
    # a (the oldest) left; b is now the oldest survivor.
    members = plan_round(cands("c:1", "c:0", "b:1", "b:0", "d:0"), ["a", "b", "c"])
    rank0 = members[0]
    assert (rank0.host, rank0.worker_id, rank0.rank) == ("b", "b0", 0)
    assert ids(members) == ["b0", "b1", "c0", "c1", "d0"]


def test_rank0_is_the_lowest_remaining_slot_when_slot0_is_gone():
    members = plan_round(cands("a:2", "a:1", "b:0"), ["a", "b"])
    assert ids(members)[0] == "a1"


def test_host_that_disappears_and_returns_goes_last():
    # Round 1: a, b, c.  a leaves; the driver keeps only member hosts in host_order.
    round1 = plan_round(cands("a:0", "b:0", "c:0"), [])
    assert ids(round1) == ["a0", "b0", "c0"]
    round2 = plan_round(cands("b:0", "c:0"), ["b", "c"])
    assert ids(round2) == ["b0", "c0"]
    # a comes back (fresh workers, listed first by discovery): it is a new host now.
    back = [Candidate("a9", "a", 0), Candidate("a10", "a", 1)] + cands("b:0", "c:0")
    round3 = plan_round(back, ["b", "c"])
    assert ids(round3) == ["b0", "c0", "a9", "a10"]
    assert round3[0].host == "b"


def test_host_order_entries_without_candidates_are_ignored():
    members = plan_round(cands("c:0", "b:0"), ["gone", "b", "also-gone", "c"])
    assert ids(members) == ["b0", "c0"]


def test_plan_round_does_not_mutate_host_order():
    host_order = ["b", "a"]
    plan_round(cands("a:0", "b:0", "c:0"), host_order)
    assert host_order == ["b", "a"]


def test_empty_round():
    assert plan_round([], ["a"]) == []
    assert plan_round([], [], max_np=3) == []


# -- plan_round: max_np ------------------------------------------------------------------------

def test_max_np_drops_the_newest_hosts_highest_slots():
    members = plan_round(cands("a:0", "a:1", "b:0", "b:1", "b:2"), ["a", "b"], max_np=3)
    assert ids(members) == ["a0", "a1", "b0"]
    assert all(m.size == 3 for m in members)


def test_max_np_drops_new_hosts_before_survivors():
    # The new host c is listed first, yet it is the newest, so it loses its slots first.
    members = plan_round(cands("c:0", "c:1", "a:0", "b:0", "b:1"), ["a", "b"], max_np=4)
    assert ids(members) == ["a0", "b0", "b1", "c0"]


def test_max_np_keeps_whole_oldest_host_even_with_high_slots():
    members = plan_round(cands("b:0", "a:3", "a:2", "a:1", "a:0"), ["a", "b"], max_np=2)
    assert ids(members) == ["a0", "a1"]


@pytest.mark.parametrize("max_np", [None, 3, 10])
def test_max_np_at_or_above_count_keeps_everyone(max_np):
    members = plan_round(cands("a:0", "b:0", "b:1"), ["a", "b"], max_np=max_np)
    assert ids(members) == ["a0", "b0", "b1"]


def test_max_np_recomputes_local_and_cross_sizes_after_truncation():
    members = by_id(plan_round(cands("a:0", "a:1", "b:0", "b:1"), ["a", "b"], max_np=3))
    assert members["b0"].local_size == 1
    assert members["a1"].cross_size == 1     # only a has a local rank 1 now
    assert members["a0"].cross_size == 2


# -- assign: local and cross ranks --------------------------------------------------------------

def test_local_rank_and_local_size_per_host():
    members = by_id(plan_round(cands("a:0", "a:1", "a:2", "b:0", "c:0", "c:1"), ["a", "b", "c"]))
    expect = {"a0": (0, 3), "a1": (1, 3), "a2": (2, 3), "b0": (0, 1), "c0": (0, 2), "c1": (1, 2)}
    assert {w: (m.local_rank, m.local_size) for w, m in members.items()} == expect


def test_local_rank_is_position_on_host_not_slot_number():
    # Slot 0 of a has gone (e.g. its worker was removed): local ranks stay dense.
    members = by_id(plan_round(cands("a:1", "a:3"), ["a"]))
    assert (members["a1"].local_rank, members["a3"].local_rank) == (0, 1)
    assert members["a3"].local_size == 2


def test_cross_rank_and_cross_size_count_hosts_having_that_local_rank():
    # a: 2 workers, b: 1 worker, c: 3 workers.
    members = by_id(plan_round(cands("a:0", "a:1", "b:0", "c:0", "c:1", "c:2"), ["a", "b", "c"]))
    expect = {
        # local rank 0 exists on a, b, c
        "a0": (0, 3), "b0": (1, 3), "c0": (2, 3),
        # local rank 1 exists on a and c only
        "a1": (0, 2), "c1": (1, 2),
        # local rank 2 exists on c only
        "c2": (0, 1),
    }
    assert {w: (m.cross_rank, m.cross_size) for w, m in members.items()} == expect


def test_cross_rank_follows_host_order():
    members = by_id(plan_round(cands("a:0", "a:1", "b:0", "b:1"), ["b", "a"]))
    assert members["b0"].cross_rank == 0 and members["a0"].cross_rank == 1
    assert members["b1"].cross_rank == 0 and members["a1"].cross_rank == 1
    assert all(m.cross_size == 2 for m in members.values())


def test_assign_keeps_the_given_order_and_fields():
    ordered = [Candidate("x", "h2", 5), Candidate("y", "h1", 0), Candidate("z", "h2", 1)]
    members = assign(ordered)
    assert members == [
        Member("x", "h2", rank=0, size=3, local_rank=0,
               local_size=2, cross_rank=0, cross_size=2),
        Member("y", "h1", rank=1, size=3, local_rank=0,
               local_size=1, cross_rank=1, cross_size=2),
        Member("z", "h2", rank=2, size=3, local_rank=1,
               local_size=2, cross_rank=0, cross_size=1),
    ]


def test_assign_empty():
    assert assign([]) == []


def test_ranks_are_a_permutation_and_consistent():
    members = plan_round(cands("a:0", "b:0", "b:1", "c:0", "c:1", "c:2", "d:0"), ["c", "a"])
    assert sorted(m.rank for m in members) == list(range(len(members)))
    for m in members:
        same_host = [o for o in members if o.host == m.host]
        assert m.local_size == len(same_host)
        same_local = [o for o in members if o.local_rank == m.local_rank]
        assert m.cross_size == len(same_local)
        assert 0 <= m.cross_rank < m.cross_size


# -- same_membership -----------------------------------------------------------------------------

def test_same_membership():
    a = plan_round(cands("a:0", "b:0"), ["a", "b"])
    assert same_membership(a, plan_round(cands("b:0", "a:0"), ["a", "b"]))
    assert same_membership([], [])
    # Same workers, different ranks: a different round.
    assert not same_membership(a, plan_round(cands("a:0", "b:0"), ["b", "a"]))
    assert not same_membership(a, plan_round(cands("a:0"), ["a"]))
    assert not same_membership(a, plan_round(cands("a:0", "b:0", "c:0"), ["a", "b"]))
    assert not same_membership([], a)


# -- describe_change -----------------------------------------------------------------------------

def test_describe_change_adds_and_removes():
    before = plan_round(cands("node-1:0", "node-1:1", "node-2:0"), [])
    after = plan_round(cands("node-1:0", "node-2:0", "node-3:0", "node-3:1"),
                       ["node-1", "node-2"])
    assert describe_change(before, after) == "+2 on node-3, -1 on node-1"


def test_describe_change_only_additions_sorted_by_host():
    before = plan_round(cands("a:0"), [])
    after = plan_round(cands("a:0", "c:0", "b:0", "b:1"), ["a"])
    assert describe_change(before, after) == "+2 on b, +1 on c"


def test_describe_change_only_removals():
    before = plan_round(cands("a:0", "b:0", "b:1", "c:0"), [])
    after = plan_round(cands("a:0"), ["a"])
    assert describe_change(before, after) == "-2 on b, -1 on c"


def test_describe_change_replacement_on_the_same_host():
    before = plan_round([Candidate("1", "h", 0)], [])
    after = plan_round([Candidate("2", "h", 0)], [])
    assert describe_change(before, after) == "+1 on h, -1 on h"


def test_describe_change_no_change_is_empty():
    members = plan_round(cands("a:0", "b:0"), [])
    reordered = plan_round(cands("a:0", "b:0"), ["b", "a"])
    assert describe_change(members, members) == ""
    assert describe_change(members, reordered) == ""   # only membership counts, not ranks


# -- the linear planner equals the straightforward one (issue 14) ----------------------------

def reference_order_hosts(host_order, hosts):
    order = [h for h in host_order if h in hosts]
    for h in hosts:
        if h not in order:
            order.append(h)
    return order


def reference_assign(ordered):
    on_host = {}
    for c in ordered:
        on_host.setdefault(c.host, []).append(c.worker_id)
    members = []
    for rank, c in enumerate(ordered):
        local_rank = on_host[c.host].index(c.worker_id)
        peers = [h for h in on_host if len(on_host[h]) > local_rank]
        members.append(Member(
            c.worker_id, c.host, rank=rank, size=len(ordered),
            local_rank=local_rank, local_size=len(on_host[c.host]),
            cross_rank=peers.index(c.host), cross_size=len(peers),
        ))
    return members


def reference_plan_round(candidates, host_order, max_np=None):
    hosts = reference_order_hosts(host_order, list(dict.fromkeys(c.host for c in candidates)))
    rank_of_host = {h: i for i, h in enumerate(hosts)}    # a repeated host: its last place
    ordered = sorted(candidates, key=lambda c: (rank_of_host[c.host], c.slot))
    return reference_assign(ordered if max_np is None else ordered[:max_np])


def random_situation(rng):
    """Hosts with various slot counts, some slots missing, a host order with gone and
    duplicated hosts, candidates in any order (now and then a repeated worker id)."""
    names = [f"h{i}" for i in range(rng.randint(0, 40))]
    candidates, next_id = [], 0
    for host in names:
        for slot in range(rng.choice([1, 1, 2, 4, 8])):
            if rng.random() < 0.8:
                candidates.append(Candidate(str(next_id), host, slot))
                next_id += 1
    if candidates and rng.random() < 0.1:
        c = rng.choice(candidates)
        candidates.append(Candidate(c.worker_id, c.host, rng.randint(0, 9)))
    rng.shuffle(candidates)
    pool = names + ["gone1", "gone2"]
    host_order = rng.sample(pool, rng.randint(0, len(pool)))
    if host_order and rng.random() < 0.2:
        host_order.append(rng.choice(host_order))
    max_np = rng.choice([None, None, 0, 1, rng.randint(0, len(candidates) + 2)])
    return candidates, host_order, max_np


def test_planner_equals_the_reference_on_random_inputs():
    import random
    rng = random.Random(14)
    for _ in range(1500):
        candidates, host_order, max_np = random_situation(rng)
        hosts = [c.host for c in candidates]
        assert order_hosts(host_order, hosts) == reference_order_hosts(host_order, hosts)
        assert plan_round(candidates, host_order, max_np) == \
            reference_plan_round(candidates, host_order, max_np)
        assert assign(candidates) == reference_assign(candidates)
