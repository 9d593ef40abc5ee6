"""Host-memory snapshots of nested state, and their per-dtype flat form.

A state is a tree of dicts, lists and tuples whose leaves are tensors or
plain values. Snapshots keep one preallocated buffer per tensor and copy into
it on every commit, because a fresh allocation pays for page faults
(DESIGN §6). Transfers flatten tensors per dtype into a few large buffers.
"""

import copy
import pickle

import torch


class _Ref:
    """Placeholder for the i-th tensor of a tree."""

    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index

    def __reduce__(self):
        return (_Ref, (self.index,))


def _map_leaves(node, leaf):
    """Rebuild a tree of dicts, lists and plain tuples, mapping every other node with ``leaf``."""
    if isinstance(node, dict):
        return {k: _map_leaves(v, leaf) for k, v in node.items()}
    if isinstance(node, list):
        return [_map_leaves(v, leaf) for v in node]
    if isinstance(node, tuple) and not hasattr(node, "_fields"):
        return tuple(_map_leaves(v, leaf) for v in node)
    return leaf(node)


def split(tree):
    """(skeleton, tensors): the tree with tensors replaced by _Ref, and the tensors."""
    tensors = []

    def leaf(node):
        if torch.is_tensor(node):
            tensors.append(node.detach())
            return _Ref(len(tensors) - 1)
        return copy.deepcopy(node)

    return _map_leaves(tree, leaf), tensors


def join(skeleton, tensors):
    """Inverse of split."""
    return _map_leaves(skeleton, lambda n: tensors[n.index] if isinstance(n, _Ref) else n)


class Snapshot:
    """The last committed copy of a state tree, kept in reusable host buffers."""

    def __init__(self):
        self.skeleton = None
        self.buffers = []

    @property
    def empty(self):
        return self.skeleton is None

    def save(self, tree):
        skeleton, tensors = split(tree)
        buffers = self.buffers
        if len(buffers) != len(tensors) or any(
            b.shape != t.shape or b.dtype != t.dtype for b, t in zip(buffers, tensors)
        ):
            buffers = [_host_buffer(t) for t in tensors]
        for buf, t in zip(buffers, tensors):
            buf.copy_(t, non_blocking=True)
        if any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()
        self.skeleton, self.buffers = skeleton, buffers

    def materialize(self, shared=False):
        """A tree of fresh tensors, so the live state never aliases the snapshot.

        ``shared=True`` hands out the snapshot's own buffers, for callers that
        copy out of them anyway (``Module.load_state_dict`` does).
        """
        buffers = self.buffers if shared else [b.clone() for b in self.buffers]
        return join(copy.deepcopy(self.skeleton), buffers)

    def nbytes(self):
        return sum(b.numel() * b.element_size() for b in self.buffers)


def _host_buffer(t):
    pin = t.is_cuda and torch.cuda.is_available()
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)


def pack(tree):
    """(header bytes, flat buffers): a tree ready to send as a few large messages."""
    skeleton, tensors = split(tree)
    by_dtype, filled = {}, {}
    layout = []
    for t in tensors:
        offset = filled.get(t.dtype, 0)
        by_dtype.setdefault(t.dtype, []).append(t.reshape(-1).cpu())
        filled[t.dtype] = offset + t.numel()
        layout.append((str(t.dtype), tuple(t.shape), offset))
    dtypes = list(by_dtype)
    flats = [torch.cat(by_dtype[d]) if by_dtype[d] else torch.empty(0, dtype=d) for d in dtypes]
    header = pickle.dumps({
        "skeleton": skeleton, "layout": layout,
        "flats": [(str(d), f.numel()) for d, f in zip(dtypes, flats)],
    })
    return header, flats


def flat_specs(header):
    """The (dtype, numel) of each flat buffer that follows a header."""
    meta = pickle.loads(header)
    return [(_dtype(d), n) for d, n in meta["flats"]]


def unpack(header, flats):
    meta = pickle.loads(header)
    by_name = {d: f for (d, _n), f in zip(meta["flats"], flats)}
    tensors = [
        by_name[d][offset: offset + _numel(shape)].view(shape)
        for d, shape, offset in meta["layout"]
    ]
    return join(meta["skeleton"], tensors)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _dtype(name):
    return getattr(torch, name.replace("torch.", ""))
