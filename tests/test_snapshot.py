"""Tests for elastic.snapshot: split/join, reusable host snapshots, pack/unpack (single process)."""

import pickle

import pytest
import torch

from elastic.state.snapshot import (
    Arena,
    Snapshot,
    TensorRef,
    flat_specs,
    join,
    numel_by_dtype,
    pack,
    split,
    unpack,
)


def _bytes(t):
    """The exact bytes of a tensor (bitwise comparison, NaN and -0.0 included)."""
    return t.detach().contiguous().cpu().numpy().tobytes()


def assert_bitwise(a, b):
    assert torch.is_tensor(a) and torch.is_tensor(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert _bytes(a) == _bytes(b)


def assert_tree_equal(a, b):
    """Same structure and container types; tensors bitwise equal; plain values equal."""
    if torch.is_tensor(a):
        assert_bitwise(a, b)
    elif isinstance(a, dict):
        assert type(b) is type(a) and list(a) == list(b)
        for k in a:
            assert_tree_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
        assert type(b) is type(a) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_tree_equal(x, y)
    else:
        assert a == b


def _tree():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4, generator=g)}},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "objects": {
            "epoch": 2, "name": "run", "none": None, "ratio": 0.5,
            "pair": (torch.arange(5), "tag", [torch.ones(2, dtype=torch.bool), 7]),
            "ids": [1, 2, 3],
        },
    }


# -- split / join ---------------------------------------------------------------------------------
def test_split_join_round_trip_nested():
    tree = _tree()
    skeleton, tensors = split(tree)
    assert len(tensors) == 6
    assert all(torch.is_tensor(t) for t in tensors)
    # The skeleton holds no tensors, only placeholders.
    seen = []

    def walk(node):
        assert not torch.is_tensor(node)
        if isinstance(node, TensorRef):
            seen.append(node.index)
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)
    walk(skeleton)
    assert sorted(seen) == list(range(len(tensors)))
    # Container types survive (tuples stay tuples, lists stay lists).
    assert isinstance(skeleton["objects"]["pair"], tuple)
    assert isinstance(skeleton["objects"]["pair"][2], list)
    assert isinstance(skeleton["optimizer"]["param_groups"][0]["betas"], tuple)
    assert_tree_equal(tree, join(skeleton, tensors))


def test_split_detaches_and_copies_plain_values():
    w = torch.randn(3, requires_grad=True)
    ids = [1, 2, 3]
    skeleton, tensors = split({"w": w, "ids": ids, "s": {1, 2}})
    assert not tensors[0].requires_grad
    ids.append(4)
    assert skeleton["ids"] == [1, 2, 3]
    assert skeleton["s"] == {1, 2}


def test_split_of_a_bare_tensor_and_of_a_leaf():
    t = torch.arange(4)
    skeleton, tensors = split(t)
    assert isinstance(skeleton, TensorRef)
    assert_bitwise(join(skeleton, tensors), t)
    skeleton, tensors = split(5)
    assert skeleton == 5 and tensors == []
    assert join(skeleton, tensors) == 5


def test_skeleton_pickles():
    skeleton, _ = split(_tree())
    again = pickle.loads(pickle.dumps(skeleton))
    assert again["model"]["w"].index == skeleton["model"]["w"].index


# -- Snapshot -------------------------------------------------------------------------------------
def test_empty_snapshot():
    snap = Snapshot()
    assert snap.empty
    assert snap.nbytes() == 0


def test_save_and_materialize_round_trip():
    tree = _tree()
    snap = Snapshot()
    snap.save(tree)
    assert not snap.empty
    assert_tree_equal(tree, snap.materialize())
    assert snap.nbytes() == sum(t.numel() * t.element_size() for t in split(tree)[1])


def test_save_copies_so_later_changes_do_not_leak_in():
    tree = _tree()
    expected = split(tree)
    expected = join(expected[0], [t.clone() for t in expected[1]])
    snap = Snapshot()
    snap.save(tree)
    tree["model"]["w"].add_(1.0)
    tree["objects"]["ids"].append(99)
    tree["objects"]["epoch"] = 100
    assert_tree_equal(expected, snap.materialize())


def test_save_reuses_buffers_when_shapes_match():
    tree = _tree()
    snap = Snapshot()
    snap.save(tree)
    ptrs = [b.data_ptr() for b in snap.buffers]
    buffers = list(snap.buffers)
    tree["model"]["w"].mul_(2.0)
    tree["optimizer"]["state"][0]["step"] += 1
    snap.save(tree)
    assert [b.data_ptr() for b in snap.buffers] == ptrs
    assert all(a is b for a, b in zip(buffers, snap.buffers))
    # ... and the reused buffers hold the new values.
    assert_tree_equal(tree, snap.materialize())


@pytest.mark.parametrize("change", ["shape", "dtype", "count"])
def test_save_reallocates_when_layout_changes(change):
    tree = _tree()
    snap = Snapshot()
    snap.save(tree)
    ptrs = [b.data_ptr() for b in snap.buffers]
    if change == "shape":
        tree["model"]["w"] = torch.randn(5, 4)
    elif change == "dtype":
        tree["model"]["w"] = tree["model"]["w"].double()
    else:
        tree["model"]["extra"] = torch.zeros(2)
    snap.save(tree)
    _, tensors = split(tree)
    assert len(snap.buffers) == len(tensors)
    for b, t in zip(snap.buffers, tensors):
        assert b.shape == t.shape and b.dtype == t.dtype
    assert snap.buffers[0].data_ptr() != ptrs[0] or change == "count"
    if change == "shape":
        assert snap.buffers[0].shape == (5, 4)
    assert_tree_equal(tree, snap.materialize())


def test_save_of_non_contiguous_tensor():
    base = torch.arange(12.0).view(3, 4)
    snap = Snapshot()
    snap.save({"t": base.t()})
    assert_bitwise(snap.materialize()["t"], base.t().contiguous())


def test_materialize_does_not_alias_the_snapshot():
    tree = _tree()
    snap = Snapshot()
    snap.save(tree)
    first = snap.materialize()
    buffer_ptrs = {b.data_ptr() for b in snap.buffers}
    _, tensors = split(first)
    for t in tensors:
        assert t.data_ptr() not in buffer_ptrs
    # Mutating everything we got back leaves the snapshot unchanged.
    for t in tensors:
        if t.dtype == torch.bool:
            t.logical_not_()
        else:
            t.add_(1)
    first["objects"]["ids"].append(4)
    first["optimizer"]["param_groups"][0]["lr"] = 123.0
    first["objects"]["epoch"] = -1
    assert_tree_equal(tree, snap.materialize())
    # Two materializations are independent of each other too.
    a, b = snap.materialize(), snap.materialize()
    a["model"]["w"].zero_()
    assert_bitwise(b["model"]["w"], tree["model"]["w"])


# -- pack / unpack --------------------------------------------------------------------------------
def _mixed_tree():
    g = torch.Generator().manual_seed(1)
    f32 = torch.randn(4, 3, generator=g)
    f32[0, 0] = float("nan")
    f32[0, 1] = -0.0
    return {
        "f32": f32,
        "f64": torch.randn(5, generator=g, dtype=torch.float64),
        "i64": torch.tensor([-(2 ** 62), 0, 2 ** 62 + 3], dtype=torch.int64),
        "bool": torch.tensor([True, False, True, True]),
        "scalar": torch.tensor(3.5),
        "scalar_i": torch.tensor(7, dtype=torch.int64),
        "nested": [torch.randn(2, 2, generator=g), ("x", torch.zeros(0, 3))],
        "non_contig": torch.arange(12, dtype=torch.float64).view(3, 4).t(),
        "plain": {"lr": 0.1, "steps": [1, 2]},
    }


def _transport(header, flats):
    """What a receiver does: allocate buffers from the header and fill them."""
    received = []
    for (dtype, numel), flat in zip(flat_specs(header), flats):
        buf = torch.empty(numel, dtype=dtype)
        buf.copy_(flat)
        received.append(buf)
    return received


def test_pack_unpack_round_trip_bitwise():
    tree = _mixed_tree()
    header, flats = pack(tree)
    assert isinstance(header, bytes)
    out = unpack(header, _transport(header, flats))
    assert_tree_equal(tree, out)
    assert out["scalar"].dim() == 0 and out["scalar_i"].dim() == 0
    assert out["nested"][1][1].shape == (0, 3)


def test_pack_groups_one_flat_per_dtype_and_flat_specs_match():
    tree = _mixed_tree()
    header, flats = pack(tree)
    dtypes = [f.dtype for f in flats]
    assert len(dtypes) == len(set(dtypes))
    assert set(dtypes) == {torch.float32, torch.float64, torch.int64, torch.bool}
    assert flat_specs(header) == [(f.dtype, f.numel()) for f in flats]
    _, tensors = split(tree)
    for d in dtypes:
        total = sum(t.numel() for t in tensors if t.dtype == d)
        assert sum(f.numel() for f in flats if f.dtype == d) == total
    for f in flats:
        assert f.dim() == 1


def test_pack_does_not_alias_its_input():
    tree = {"a": torch.zeros(3), "b": torch.ones(2)}
    header, flats = pack(tree)
    tree["a"].add_(5)
    out = unpack(header, flats)
    assert_bitwise(out["a"], torch.zeros(3))


def test_pack_unpack_without_tensors_and_with_only_empty_tensors():
    header, flats = pack({"x": 1, "y": [2, "z"]})
    assert flats == [] and flat_specs(header) == []
    assert unpack(header, []) == {"x": 1, "y": [2, "z"]}
    tree = {"e": torch.empty(0, dtype=torch.float64)}
    header, flats = pack(tree)
    assert flat_specs(header) == [(torch.float64, 0)]
    assert_tree_equal(tree, unpack(header, _transport(header, flats)))


# -- flat snapshots and transfers straight from / into them ---------------------------------------
def _fill(tree, value):
    _, tensors = split(tree)
    for t in tensors:
        t.fill_(value)
    return tree


def test_snapshot_buffers_are_views_into_one_flat_per_dtype():
    tree = _tree()
    snap = Snapshot()
    snap.save(tree)
    flats = snap.flats()
    assert [f.dtype for f in flats] == list(dict.fromkeys(b.dtype for b in snap.buffers))
    storages = {f.dtype: f.untyped_storage().data_ptr() for f in flats}
    for b in snap.buffers:
        assert b.untyped_storage().data_ptr() == storages[b.dtype]
    assert sum(f.numel() * f.element_size() for f in flats) == snap.nbytes()
    # The header describes the flats in pack()'s format: unpack rebuilds the tree.
    assert flat_specs(snap.header()) == [(f.dtype, f.numel()) for f in flats]
    assert_tree_equal(tree, unpack(snap.header(), flats))
    # A commit copies into the same flats.
    snap.save(_fill(_tree(), 1))
    assert all(a is b for a, b in zip(flats, snap.flats()))
    assert all(bool((b == 1).all()) for b in snap.buffers)


def test_receive_into_own_flats_when_layout_matches_else_new_ones():
    sender, receiver = Snapshot(), Snapshot()
    sender.save(_tree())
    receiver.save(_fill(_tree(), 0))
    own = receiver.flats()
    flats = receiver.receive_buffers(sender.header())
    assert all(a is b for a, b in zip(flats, own))
    for dst, src in zip(flats, sender.flats()):
        dst.copy_(src)
    receiver.install(sender.header(), flats)
    assert all(a is b for a, b in zip(receiver.flats(), own))
    assert_tree_equal(sender.materialize(), receiver.materialize())
    # Another layout: new buffers, and the snapshot takes the sender's layout.
    other = Snapshot()
    other.save({"x": torch.zeros(7), "n": 3})
    flats = other.receive_buffers(sender.header())
    assert not any(a is b for a, b in zip(flats, other.flats()))
    for dst, src in zip(flats, sender.flats()):
        dst.copy_(src)
    other.install(sender.header(), flats)
    assert other.intact
    assert_tree_equal(sender.materialize(), other.materialize())
    other.save(_fill(_tree(), 2))      # commits reuse the installed flats
    assert all(a is b for a, b in zip(other.flats(), flats))


def test_receive_into_reserved_flats_when_their_specs_fit():
    sender = Snapshot()
    sender.save(_tree())
    newcomer = Snapshot()
    newcomer.reserve(sender.specs())
    assert newcomer.empty and newcomer.reserved == sender.specs()
    reserved = newcomer.reserved_flats
    assert all(f.count_nonzero() == 0 for f in reserved)      # touched: written once
    flats = newcomer.receive_buffers(sender.header())
    assert all(a is b for a, b in zip(flats, reserved)) and newcomer.reserved is None
    for dst, src in zip(flats, sender.flats()):
        dst.copy_(src)
    newcomer.install(sender.header(), flats)
    assert newcomer.intact
    assert_tree_equal(sender.materialize(), newcomer.materialize())
    # A stale reserve (another layout) is not used, and stays until dropped.
    stale = Snapshot()
    stale.reserve([("torch.float32", 3)])
    flats = stale.receive_buffers(sender.header())
    assert stale.reserved == [("torch.float32", 3)]
    assert [(str(f.dtype), f.numel()) for f in flats] == sender.specs()
    stale.drop_reserve()
    assert stale.reserved is None


def test_arena_hands_out_touched_memory_in_order_then_falls_back_to_fresh():
    a = torch.arange(6, dtype=torch.float32).view(2, 3)
    b = torch.tensor(2.5)                       # a 0-d tensor (an optimizer's step)
    c = torch.arange(4, dtype=torch.int64)
    arena = Arena(numel_by_dtype([a, b]) + [("torch.int64", 2)])
    assert numel_by_dtype([a, b, c]) == [("torch.float32", 7), ("torch.int64", 4)]
    ca, cb, cc = arena.clone(a), arena.clone(b), arena.clone(c)
    for orig, copy_ in ((a, ca), (b, cb), (c, cc)):
        assert_bitwise(orig, copy_)
        assert copy_.data_ptr() != orig.data_ptr()
    # a and b share the arena's float32 flat, one after the other; c did not fit.
    assert ca.untyped_storage().data_ptr() == cb.untyped_storage().data_ptr()
    assert cb.data_ptr() == ca.data_ptr() + 6 * 4
    assert cc.untyped_storage().data_ptr() != ca.untyped_storage().data_ptr()
    assert arena.taken == 2
    # Copies are independent of their sources and of each other.
    ca.add_(1)
    assert_bitwise(b, cb)
    assert float(a.sum()) == 15.0
    assert arena.clone(torch.ones(1)).data_ptr() not in (ca.data_ptr(), cb.data_ptr())
    assert arena.taken == 2                     # full: a fresh copy


def test_first_save_takes_reserved_flats_of_its_layout():
    ref = Snapshot()
    ref.save(_tree())
    snap = Snapshot()
    snap.reserve(ref.specs())
    reserved = snap.reserved_flats
    snap.save(_tree())
    assert all(a is b for a, b in zip(snap.flats(), reserved)) and snap.reserved is None
    assert_tree_equal(snap.materialize(), _tree())


def test_swapped_buffer_makes_flats_unavailable_until_reallocated():
    snap = Snapshot()
    snap.save(_tree())
    own = snap.flats()
    retired = snap.buffers[0]
    assert not snap.swap_buffer(0, torch.empty_like(retired), torch.empty_like(retired))
    assert snap.intact      # only the buffer the writer reads is swapped out
    assert snap.swap_buffer(0, retired, torch.empty_like(retired))   # a checkpoint writer's swap
    assert not snap.intact and snap.flats() is None
    other = Snapshot()
    other.save(_tree())
    # Never receive into flats a writer may still read.
    assert not any(a is b for a, b in zip(snap.receive_buffers(other.header()), own))
    snap.save(_fill(_tree(), 3))
    assert bool((snap.buffers[0] == 3).all()) and not bool((retired == 3).all())
    snap.discard()
    assert snap.empty and snap.buffers == [] and snap.flats() is None


def test_large_buffers_and_clones_are_plain_tensors():
    from elastic.state.snapshot import host_clone, host_empty
    t = host_empty(3 << 20, torch.float32)
    assert t.shape == (3 << 20,) and t.dtype == torch.float32
    src = torch.randn(5 << 20)
    c = host_clone(src)
    assert_bitwise(c, src)
    assert c.data_ptr() != src.data_ptr()
