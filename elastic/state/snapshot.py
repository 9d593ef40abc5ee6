"""Host-memory snapshots of nested state, and their per-dtype flat form.

A state is a tree of dicts, lists and tuples whose leaves are tensors or
plain values. Snapshots keep one preallocated flat buffer per dtype, with a
view per tensor, and copy into the views on every commit, because a fresh
allocation pays for page faults (docs/architecture.md, "Why commits copy
into preallocated buffers"). Transfers use the same per-dtype
flat form, so a sync sends a snapshot's flats as they are.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import hashlib
import pickle
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from elastic import tensor_tree
from elastic.worker.devices import synchronize_devices

# The tree helpers live in elastic/tensor_tree.py (checkpoint/ uses them too, without
# importing state/); their names stay here, where checkpoints' pickles find TensorRef.
TensorRef = tensor_tree.TensorRef
_Ref = TensorRef   # the name in checkpoints written before the rename
split = tensor_tree.split
join = tensor_tree.join

Spec = tuple[str, int]                          # a flat buffer: (dtype name, numel)
Placed = tuple[str, tuple[int, ...], int]       # a tensor: (dtype name, shape, offset in its flat)


class Snapshot:
    """The last committed copy of a state tree, kept in reusable host buffers.

    The tensors live in one flat buffer per dtype (in order of first appearance);
    ``buffers`` holds a view into it per tensor. A commit copies into the views,
    so nothing is allocated while the layout stays the same, and a sync sends the
    flat buffers as they are and receives into them (``header``, ``flats``,
    ``receive_buffers``, ``install``).

    A checkpoint writer that still reads ``buffers[i]`` swaps a spare tensor in
    through ``swap_buffer`` (elastic.checkpoint); nobody edits ``buffers`` from
    outside. The flats only stand for the snapshot while every buffer is still its
    own view (``intact``).
    """

    def __init__(self) -> None:
        self.skeleton: Any = None
        self.buffers: list[torch.Tensor] = []
        self._flats: list[torch.Tensor] = []      # one per dtype
        self._views: list[torch.Tensor] = []      # per tensor: its view into the flats, as allocated
        self._layout: list[Placed] = []           # per tensor, in its dtype's flat
        self._specs: list[Spec] = []              # per flat
        # per tensor: the live tensor it was saved from, and its fingerprint (see ``unchanged``)
        self._sources: list[tuple[torch.Tensor, tuple | None]] | None = None
        # flats allocated and touched ahead of a sync, with their specs (see ``reserve``)
        self._reserve: tuple[list[Spec], list[torch.Tensor]] | None = None

    @property
    def empty(self) -> bool:
        return self.skeleton is None

    @property
    def intact(self) -> bool:
        """Whether the flats hold the snapshot (no buffer was swapped out)."""
        return len(self.buffers) == len(self._views) and all(
            b is v for b, v in zip(self.buffers, self._views))

    def swap_buffer(self, index: int, expected: torch.Tensor, replacement: torch.Tensor) -> bool:
        """Put ``replacement`` in place of buffer ``index`` if that still is ``expected``
        (a checkpoint writer reads it: the next save must not overwrite it); returns
        whether it did. The next save copies into ``replacement``."""
        if index >= len(self.buffers) or self.buffers[index] is not expected:
            return False
        if replacement.shape != expected.shape or replacement.dtype != expected.dtype:
            raise ValueError("a swapped-in buffer must have the shape and dtype of the old one")
        self.buffers[index] = replacement
        return True

    def save(self, tree: Any) -> None:
        skeleton, tensors = split(tree)
        buffers = self.buffers
        if len(buffers) != len(tensors) or any(
            b.shape != t.shape or b.dtype != t.dtype for b, t in zip(buffers, tensors)
        ):
            pin = any(t.is_cuda for t in tensors) and torch.cuda.is_available()
            self._allocate(_layout_of(tensors), pin)
            buffers = self.buffers
        for buf, t in zip(buffers, tensors):
            buf.copy_(t, non_blocking=True)
        # Non-blocking copies from every device must land before anyone reads the
        # buffers: one synchronize per device where tensors live, not only the current one.
        synchronize_devices(tensors)
        self.skeleton = skeleton
        self.remember(tensors)

    # -- has the live state changed since? ------------------------------------------------------
    def remember(self, tensors: Sequence[torch.Tensor]) -> None:
        """Note the live tensors that now equal the snapshot (after a save or a restore).

        Each is kept with its address and its version counter, which every in-place
        operation bumps (optimizer steps, ``copy_``, ``load_state_dict``). Holding the
        tensor keeps its memory from being reused by another one.
        """
        self._sources = [(t, _fingerprint(t)) for t in tensors]

    def unchanged(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` (a fresh capture of the live state, in the order saved) are
        the very tensors remembered, modified by no in-place operation since, and the
        flats still hold the snapshot: then the flats can be sent for them.

        Blind spot: a write through ``.data`` (a separate version counter) is not seen;
        reset callbacks that change tensors that way should call ``state.save()``.
        """
        src = self._sources
        if src is None or not self.intact or len(src) != len(tensors):
            return False
        return all(fp is not None and _fingerprint(t) == fp for t, (_old, fp) in zip(tensors, src))

    def layout_id(self) -> int:
        """A 62-bit id of the flats' layout: equal ids mean byte ranges line up across ranks."""
        digest = hashlib.blake2b(repr((self._layout, self._specs)).encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "little") >> 2

    def materialize(self, shared: bool = False) -> Any:
        """A tree of fresh tensors, so the live state never aliases the snapshot.

        ``shared=True`` hands out the snapshot's own buffers, for callers that
        copy out of them anyway (``Module.load_state_dict`` does).
        """
        buffers = self.buffers if shared else [host_clone(b) for b in self.buffers]
        return join(copy.deepcopy(self.skeleton), buffers)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def specs(self) -> list[Spec]:
        """Per flat buffer: (dtype name, numel), as ``reserve`` takes them."""
        return [(d, int(n)) for d, n in self._specs]

    # -- memory touched ahead of a sync ----------------------------------------------------------
    def reserve(self, specs: Iterable[Spec], pin: bool = False) -> None:
        """Allocate flats of ``specs`` [(dtype name, numel)] now and write every page.

        A newcomer calls this before it is admitted (off everyone's critical path):
        then its sync receives into memory in use instead of paying a page fault per
        page while the bytes arrive (several times slower on a VM), and the first
        ``receive_buffers`` or ``save`` whose flats have these specs takes them.
        """
        wanted = [(str(d), int(n)) for d, n in specs]
        if self._reserve is not None and self._reserve[0] == wanted:
            return
        self._reserve = (wanted, touched_flats(wanted, pin))

    @property
    def reserved(self) -> list[Spec] | None:
        """The specs of the flats ``reserve`` holds, or None."""
        return None if self._reserve is None else list(self._reserve[0])

    @property
    def reserved_flats(self) -> list[torch.Tensor]:
        """The flats ``reserve`` holds (empty when none)."""
        return [] if self._reserve is None else list(self._reserve[1])

    def drop_reserve(self) -> None:
        self._reserve = None

    def _take_reserve(self, specs: Iterable[Spec]) -> list[torch.Tensor] | None:
        """The reserved flats if they have ``specs`` (then no longer reserved), else None."""
        if self._reserve is None or self._reserve[0] != [(str(d), int(n)) for d, n in specs]:
            return None
        flats = self._reserve[1]
        self._reserve = None
        return flats

    # -- transfers ----------------------------------------------------------------------------
    def header(self, skeleton: Any = None) -> bytes:
        """The bytes that describe ``flats()`` to a receiver (the format of ``pack``);
        ``skeleton``: the live one, when it differs (a reset callback changed an lr)."""
        return pickle.dumps({"skeleton": self.skeleton if skeleton is None else skeleton,
                             "layout": self._layout, "flats": self._specs})

    def flats(self) -> list[torch.Tensor] | None:
        """The flat buffers, or None while they do not hold the snapshot (see ``intact``)."""
        return list(self._flats) if not self.empty and self.intact else None

    def receive_buffers(self, header: bytes) -> list[torch.Tensor]:
        """Flat buffers to receive a sender's ``header``/``flats()`` into: this snapshot's
        own when the layout matches and they are intact (the caller must own them: no
        checkpoint writer reading them), else the reserved ones when they fit (memory
        already touched: ``reserve``), otherwise new ones. Then ``install``."""
        meta = pickle.loads(header)
        if meta["layout"] == self._layout and meta["flats"] == self._specs and self.intact \
                and self._flats:
            return list(self._flats)
        reserved = self._take_reserve(meta["flats"])
        if reserved is not None:
            return list(reserved)
        pin = torch.cuda.is_available()   # received state goes on to a GPU: pin it too
        return [host_empty(n, _dtype(d), pin) for d, n in meta["flats"]]

    def install(self, header: bytes, flats: list[torch.Tensor]) -> None:
        """Make the received ``flats`` (from ``receive_buffers``) this snapshot."""
        meta = pickle.loads(header)
        self._sources = None            # the live state is loaded (and remembered) after this
        if not (len(flats) == len(self._flats) and all(
                a is b for a, b in zip(flats, self._flats))):
            self._set_flats(meta["layout"], meta["flats"], flats)
        self.skeleton = meta["skeleton"]

    def discard(self) -> None:
        """Forget the snapshot and drop its buffers (e.g. after a failed receive into them)."""
        Snapshot.__init__(self)

    # -- internals -----------------------------------------------------------------------------
    def _allocate(self, layout: list[Placed], pin: bool) -> None:
        totals: dict[str, int] = {}
        for d, shape, offset in layout:
            totals[d] = max(totals.get(d, 0), offset + _numel(shape))
        specs = list(totals.items())
        flats = self._take_reserve(specs)
        if flats is None:
            flats = [host_empty(n, _dtype(d), pin) for d, n in specs]
        self._set_flats(layout, specs, flats)

    def _set_flats(self, layout: list[Placed], specs: list[Spec], flats: list[torch.Tensor]) -> None:
        by_name = {d: f for (d, _n), f in zip(specs, flats)}
        self._views = [by_name[d][offset: offset + _numel(shape)].view(shape)
                       for d, shape, offset in layout]
        self._flats, self._layout, self._specs = list(flats), list(layout), list(specs)
        self.buffers = list(self._views)


class Arena:
    """Touched host memory handed out in order, one flat per dtype.

    A newcomer's first restore copies what its live objects keep (optimizer state:
    an optimizer holds the tensors it is given, so they cannot be the snapshot's)
    into fresh memory, and fresh memory costs a page fault per page in the pause.
    Allocated and written before admission (a State built while a job runs) from the
    per-dtype sizes rank 0 publishes, it turns those faults into plain copies.
    """

    def __init__(self, specs: Iterable[Spec]) -> None:
        wanted = [(str(d), int(n)) for d, n in specs]
        self._flats = dict(zip((d for d, _n in wanted), touched_flats(wanted)))
        self._used = dict.fromkeys(self._flats, 0)
        self.taken = 0        # tensors copied into the arena (the rest got fresh memory)

    def clone(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` in the arena while it has room for it, else ``host_clone``."""
        d, n = str(t.dtype), t.numel()
        flat = self._flats.get(d)
        if flat is None or t.device.type != "cpu" or self._used[d] + n > flat.numel():
            return host_clone(t)
        out = flat[self._used[d]: self._used[d] + n].view(t.shape)
        self._used[d] += n
        self.taken += 1
        return out.copy_(t)


def touched_flats(specs: Iterable[Spec], pin: bool = False) -> list[torch.Tensor]:
    """One flat per (dtype name, numel) of ``specs``, every page written once."""
    flats = [host_empty(n, _dtype(d), pin) for d, n in specs]
    for f in flats:
        f.zero_()
    return flats


def numel_by_dtype(tensors: Iterable[torch.Tensor]) -> list[Spec]:
    """[(dtype name, total numel)] of ``tensors``, in order of first appearance."""
    totals: dict[str, int] = {}
    for t in tensors:
        totals[str(t.dtype)] = totals.get(str(t.dtype), 0) + t.numel()
    return list(totals.items())


_HUGE = 2 << 20                 # a transparent huge page
_MADV_HUGEPAGE = 14
_libc: list = []


def _advise_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """Ask Linux to back a large, not yet touched host tensor with transparent huge
    pages (where THP is in ``madvise`` mode): faulting fresh memory in 4 KiB pages
    runs several times slower than copying into touched memory, and a sync's
    buffers are fresh on a newcomer. Best effort: anything unusual is ignored."""
    if not sys.platform.startswith("linux") or t.numel() * t.element_size() < 2 * _HUGE:
        return t
    try:
        if not _libc:
            _libc.append(ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True))
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        lo, hi = (start + _HUGE - 1) & ~(_HUGE - 1), end & ~(_HUGE - 1)
        if hi > lo:
            _libc[0].madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE)
    except Exception:  # noqa: BLE001 - only an optimization
        pass
    return t


def _fingerprint(t: torch.Tensor) -> tuple | None:
    try:
        return (t.data_ptr(), t._version, t.dtype, tuple(t.shape), t.stride(), t.device)
    except RuntimeError:        # inference tensors have no version counter
        return None


def host_empty(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """A new flat host buffer; large unpinned ones are advised to use huge pages."""
    t = torch.empty(numel, dtype=dtype, pin_memory=pin)
    return t if pin else _advise_huge_pages(t)


def host_clone(t: torch.Tensor) -> torch.Tensor:
    """``t.clone()`` for a host tensor, into memory advised to use huge pages."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return t.clone()
    out = _advise_huge_pages(torch.empty_like(t))
    return out.copy_(t)


def _layout_of(tensors: Sequence[torch.Tensor]) -> list[Placed]:
    """Per tensor (dtype name, shape, offset in its dtype's flat); flats in order of first use."""
    filled: dict[str, int] = {}
    layout: list[Placed] = []
    for t in tensors:
        d = str(t.dtype)
        offset = filled.get(d, 0)
        filled[d] = offset + t.numel()
        layout.append((d, tuple(t.shape), offset))
    return layout


def pack(tree: Any) -> tuple[bytes, list[torch.Tensor]]:
    """(header bytes, flat buffers): a tree ready to send as a few large messages."""
    skeleton, tensors = split(tree)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    filled: dict[torch.dtype, int] = {}
    layout: list[Placed] = []
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


def flat_specs(header: bytes) -> list[tuple[torch.dtype, int]]:
    """The (dtype, numel) of each flat buffer that follows a header."""
    meta = pickle.loads(header)
    return [(_dtype(d), n) for d, n in meta["flats"]]


def unpack(header: bytes, flats: Sequence[torch.Tensor]) -> Any:
    meta = pickle.loads(header)
    by_name = {d: f for (d, _n), f in zip(meta["flats"], flats)}
    tensors = [
        by_name[d][offset: offset + _numel(shape)].view(shape)
        for d, shape, offset in meta["layout"]
    ]
    return join(meta["skeleton"], tensors)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))
