"""Tests for elastic.sampler.ElasticSampler, with ranks simulated in one process."""

import random
from collections import Counter

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from elastic.training.sampler import ElasticSampler


def make_ranks(n, size, state=None, **kw):
    """One sampler per simulated rank, optionally loaded from a saved state."""
    samplers = []
    for r in range(size):
        s = ElasticSampler(list(range(n)), **kw)
        s.reset(rank=r, size=size)
        if state is not None:
            s.load_state_dict(state)
        samplers.append(s)
    return samplers


def run_steps(samplers, batch, steps):
    """All ranks consume `steps` batches in lockstep. Returns the consumed indices."""
    consumed = []
    for b in range(steps):
        for s in samplers:
            idx = s.get_indices(b, batch)
            consumed.extend(idx)
            s.record_batch(b, batch)
    return consumed


def run_to_end(samplers):
    """All ranks iterate over their remaining lists. Returns the consumed indices."""
    lens = {len(s) for s in samplers}
    assert len(lens) == 1, "all ranks must have the same number of samples"
    consumed = []
    for s in samplers:
        items = list(s)
        consumed.extend(items)
        s.record_indices(items)
    return consumed


# ---------------------------------------------------------------- single rank

def test_size_one_full_permutation_and_determinism():
    a = make_ranks(50, 1, seed=3)[0]
    b = make_ranks(50, 1, seed=3)[0]
    assert sorted(a) == list(range(50))
    assert list(a) == list(b)
    assert list(a) != list(range(50))  # it is actually shuffled
    first = list(a)
    a.set_epoch(1)
    assert sorted(a) == list(range(50))
    assert list(a) != first
    assert list(make_ranks(50, 1, seed=4)[0]) != first


def test_no_shuffle_is_identity_order():
    s = make_ranks(10, 1, shuffle=False)[0]
    assert list(s) == list(range(10))
    s.set_epoch(5)
    assert list(s) == list(range(10))


def test_default_rank_size_without_runtime():
    s = ElasticSampler(TensorDataset(torch.arange(12)))
    assert len(s) == 12 and sorted(s) == list(range(12))


def test_len_matches_iter():
    for n in (0, 1, 7, 10, 101):
        for size in (1, 2, 3, 8):
            for drop_last in (False, True):
                for s in make_ranks(n, size, drop_last=drop_last):
                    assert len(s) == len(list(s))


def test_iter_not_affected_by_record_batch_during_iteration():
    s = make_ranks(20, 1)[0]
    expected = list(s)
    seen = []
    for i, idx in enumerate(s):
        seen.append(idx)
        s.record_batch(i, 1)
    assert seen == expected
    assert s.remaining == 0


# ---------------------------------------------------------------- exactly once

def simulate(n, schedule, batch, use_reset=False, seed=0):
    """Run one epoch through a list of (size, steps) segments; the last segment
    runs until the epoch is exhausted. Each segment change is a membership
    change, carried over either via state_dict or via reset() on survivors."""
    samplers = make_ranks(n, schedule[0][0], seed=seed)
    segments = []
    for i, (size, steps) in enumerate(schedule):
        if i > 0:
            if use_reset:
                proto = samplers[0]
                new = []
                for r in range(size):
                    s = samplers[r] if r < len(samplers) else None
                    if s is None:  # a newly joined rank starts from the broadcast state
                        s = ElasticSampler(list(range(n)), seed=seed)
                        s.reset(rank=r, size=size)
                        s.load_state_dict(proto.state_dict())
                    new.append(s)
                for r, s in enumerate(new):
                    if s in samplers:
                        s.reset(rank=r, size=size)
                samplers = new
            else:
                samplers = make_ranks(n, size, samplers[0].state_dict(), seed=seed)
        if i == len(schedule) - 1:
            segments.append(run_to_end(samplers))
        else:
            segments.append(run_steps(samplers, batch, steps))
    return segments, samplers


SCHEDULES = [
    [(1, 0)],
    [(4, 2), (8, 1), (2, 3), (1, 0)],           # up, down, to 1
    [(3, 2), (5, 1), (2, 2), (7, 0)],           # uneven sizes
    [(2, 1), (1, 2), (6, 1), (3, 0)],
    [(5, 3), (5, 1), (4, 0)],                   # same size change, then down
]


def check_exactly_once(segments, sizes, n):
    """Every index is consumed; nothing repeats until the epoch runs out, and the
    segment that runs it out repeats fewer samples than it has ranks (padding)."""
    seen = Counter()
    exhausted = False
    for seg, size in zip(segments, sizes):
        if exhausted:
            assert seg == [], "samples handed out after the epoch ended"
            continue
        fresh = Counter(seg)
        extra = sum(fresh.values()) - len(fresh) + sum(1 for i in fresh if i in seen)
        seen.update(seg)
        if len(seen) == n:
            exhausted = True
            assert extra < size, "more duplicates than end-of-epoch padding allows"
        else:
            assert extra == 0, "an index repeated before the epoch ended"
    assert exhausted and set(seen) == set(range(n))


@pytest.mark.parametrize("n", [1, 7, 100, 101])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("use_reset", [False, True])
def test_exactly_once_across_membership_changes(n, schedule, use_reset):
    segments, samplers = simulate(n, schedule, batch=3, use_reset=use_reset)
    check_exactly_once(segments, [size for size, _ in schedule], n)
    assert all(s.remaining == 0 for s in samplers)


def test_exactly_once_random_schedules():
    rng = random.Random(1234)
    for trial in range(300):
        n = rng.choice([1, 2, 7, 33, 100, 101])
        batch = rng.randint(1, 5)
        schedule = [(rng.randint(1, 9), rng.randint(0, 4)) for _ in range(rng.randint(1, 6))]
        segments, samplers = simulate(n, schedule, batch, use_reset=trial % 2 == 0, seed=trial)
        check_exactly_once(segments, [size for size, _ in schedule], n)
        assert samplers[0].remaining == 0


def test_global_progress_is_prefix_count():
    samplers = make_ranks(100, 4)
    run_steps(samplers, batch=5, steps=2)
    for s in samplers:
        assert s.processed_num == 40
        assert s.remaining == 60
        assert s.state_dict()["processed"] == 40


# ---------------------------------------------------------------- end of epoch

def test_padding_only_at_epoch_end():
    n, size = 10, 4  # ceil(10/4) = 3 per rank, 2 padded slots
    samplers = make_ranks(n, size)
    per_rank = [list(s) for s in samplers]
    assert all(len(p) == 3 for p in per_rank)
    # The first two rounds are distinct real samples; only the last round wraps.
    first_rounds = [idx for p in per_rank for idx in p[:2]]
    assert len(set(first_rounds)) == 8
    last_round = [p[2] for p in per_rank]
    counts = Counter(idx for p in per_rank for idx in p)
    assert set(counts) == set(range(n))
    dups = [i for i, c in counts.items() if c > 1]
    assert len(dups) == 2 and set(dups) <= set(last_round)
    # The wrap-around padding repeats the first samples of the remaining permutation.
    perm = list(make_ranks(n, 1)[0])
    assert last_round == [perm[8], perm[9], perm[0], perm[1]]


def test_drop_last_even_split_no_duplicates():
    samplers = make_ranks(10, 4, drop_last=True)
    per_rank = [list(s) for s in samplers]
    assert all(len(p) == 2 for p in per_rank)
    flat = [i for p in per_rank for i in p]
    assert len(flat) == len(set(flat)) == 8
    for s, p in zip(samplers, per_rank):
        s.record_indices(p)
    assert samplers[0].processed_num == 8 and samplers[0].remaining == 2


def test_drop_last_short_batch_not_overcounted():
    # 10 samples, 3 ranks, drop_last: 3 each, batches of 2 then a short batch of 1.
    samplers = make_ranks(10, 3, drop_last=True)
    run_steps(samplers, batch=2, steps=2)
    assert samplers[0].processed_num == 9  # not min(10, 12)


def test_drop_last_across_membership_changes_never_repeats():
    samplers = make_ranks(101, 3, drop_last=True)
    consumed = run_steps(samplers, batch=4, steps=3)
    samplers = make_ranks(101, 5, samplers[0].state_dict(), drop_last=True)
    consumed += run_to_end(samplers)
    assert len(consumed) == len(set(consumed))
    assert 101 - len(consumed) < 5


# ---------------------------------------------------------------- state and epochs

def test_state_dict_is_small():
    s = make_ranks(1000, 3)[1]
    run_steps([s], batch=7, steps=2)
    sd = s.state_dict()
    assert set(sd) == {"epoch", "processed", "seed", "shuffle"}
    for key in ("epoch", "processed", "seed"):
        assert type(sd[key]) is int
    assert type(sd["shuffle"]) is bool
    assert sd["processed"] == 7 * 2 * 3


def test_load_state_dict_resumes_remaining():
    a = make_ranks(30, 1, seed=9)[0]
    full = list(a)
    a.record_batch(0, 12)
    b = make_ranks(30, 1)[0]  # seed comes from the saved state
    b.load_state_dict(a.state_dict())
    assert list(b) == full[12:]
    with pytest.raises(ValueError):
        b.load_state_dict({"epoch": 0, "processed": 31, "seed": 0, "shuffle": True})


def test_set_epoch_same_keeps_progress_different_restarts():
    s = make_ranks(20, 1)[0]
    full = list(s)
    s.record_batch(0, 5)
    s.set_epoch(0)  # same epoch: resume, do not retrain
    assert list(s) == full[5:]
    assert s.processed_num == 5
    s.set_epoch(1)
    assert s.processed_num == 0 and len(s) == 20
    s.record_batch(0, 3)
    s.set_epoch(0)  # back to another epoch: start from scratch
    assert list(s) == full


def test_restore_then_set_epoch_resumes_mid_epoch():
    a = make_ranks(40, 2)
    run_steps(a, batch=4, steps=2)
    sd = a[0].state_dict()
    b = make_ranks(40, 2, sd)
    for s in b:
        s.set_epoch(sd["epoch"])
    assert sum(len(s) for s in b) == 40 - 16


def test_reset_folds_progress_with_old_size():
    samplers = make_ranks(50, 5)
    run_steps(samplers, batch=2, steps=1)
    s = samplers[0]
    s.reset(rank=0, size=2)
    assert s.processed == 10 and s.processed_num == 10
    assert len(s) == 20


def test_invalid_rank_size():
    s = make_ranks(5, 1)[0]
    with pytest.raises(ValueError):
        s.reset(rank=2, size=2)
    with pytest.raises(ValueError):
        s.reset(rank=0, size=0)


# ---------------------------------------------------------------- bad datasets

class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


class _NoLen:
    def __getitem__(self, i):
        return i


def test_iterable_dataset_rejected():
    with pytest.raises(TypeError, match="IterableDataset"):
        ElasticSampler(_Stream())


def test_dataset_without_len_rejected():
    with pytest.raises(TypeError, match="__len__"):
        ElasticSampler(_NoLen())
