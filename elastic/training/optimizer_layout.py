"""How DistributedOptimizer lays gradients out in buckets.

One bucket is one flat buffer and one allreduce. Parameters are taken in
reverse order (the order backward produces their gradients); a bucket holds one
dtype and device, or exactly one of the caller's ``groups``. The layout depends
only on the parameters and the arguments, so every rank builds the same one.

A size-capped bucket closes right *after* the parameter that brings it to ``cap``
bytes (so it may exceed the cap by that one parameter), as torch DDP's do. Closing
it *before* a parameter that would not fit left the small bias taken just before
a layer's weight in the earlier bucket, and a layer's bias and weight gradients
come from the same backward node: every bucket then waited for one more layer's
backward before it could leave (docs/benchmarks.md, the DistributedOptimizer row
at 300 Mbit/s). The first bucket closes at ``FIRST_BUCKET_BYTES`` (DDP's 1 MiB), so
the link starts working after the last layers' backward, not after 25 MB of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from elastic.worker import collectives

if TYPE_CHECKING:
    from elastic.training.compression import Compressor
    from elastic.training.optimizer_checks import ReducingSet

FIRST_BUCKET_BYTES = 1 << 20    # the first size-capped bucket of each dtype and device


class Bucket:
    """One flat buffer, a view per parameter, and the per-cycle bookkeeping."""

    __slots__ = ("index", "params", "views", "ctxs", "flat", "nbytes", "ready", "handle",
                 "as_view", "cast_only", "loose", "sparse", "frozen")

    def __init__(self, index: int) -> None:
        self.index = index
        self.params: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []
        self.ctxs: list[Any] = []      # each parameter's compressor context
        self.flat: torch.Tensor | None = None
        self.nbytes, self.ready = 0, 0
        self.handle: tuple | None = None   # the allreduce in flight (collectives.synchronize)
        self.as_view = self.cast_only = False
        self.loose: list[torch.Tensor] = []   # params whose p.grad is not a bucket view (compressed)
        # this cycle: (param, position, sparse_dim) to hand back sparse
        self.sparse: list[tuple[torch.Tensor, int, int]] = []
        self.frozen: list[torch.Tensor] = []  # this cycle: params frozen since the build (no gradient)


def _explicit(trainable: list[torch.Tensor],
              groups: int | Sequence[Sequence[torch.Tensor]] | None) -> dict[torch.Tensor, int]:
    """Per trainable param, its group number, or None."""
    if groups is None:
        return {}
    if isinstance(groups, int):
        n = min(groups, len(trainable)) or 1
        per, extra = divmod(len(trainable), n)
        of: dict[torch.Tensor, int] = {}
        start = 0
        for g in range(n):
            size = per + (1 if g < extra else 0)
            for p in trainable[start:start + size]:
                of[p] = g
            start += size
        return of
    live = set(trainable)
    return {p: g for g, members in enumerate(groups) for p in members if p in live}


def build_buckets(trainable: list[torch.Tensor], groups: int | Sequence[Sequence[torch.Tensor]] | None,
                  cap: float, compression: Compressor, as_view: bool) -> list[Bucket]:
    """The buckets for these trainable parameters, with their buffers allocated.

    ``as_view``: the compressor leaves gradients as they are, so parameters' gradients
    can be views into the buffers.
    """
    group_of = _explicit(trainable, groups)
    buckets: list[Bucket] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], Bucket] = {}
    closed: set[tuple[torch.dtype, torch.device]] = set()   # keys whose first bucket closed
    group_buckets: dict[tuple[int, torch.dtype, torch.device], Bucket] = {}
    for p in reversed(trainable):
        nbytes = p.numel() * p.element_size()
        g = group_of.get(p)
        if g is not None:
            in_group = (g, p.dtype, p.device)
            bucket = group_buckets.get(in_group)
            if bucket is None:
                bucket = group_buckets[in_group] = Bucket(len(buckets))
                buckets.append(bucket)
        else:
            key = (p.dtype, p.device)
            bucket = open_buckets.get(key)
            if bucket is None:
                bucket = open_buckets[key] = Bucket(len(buckets))
                buckets.append(bucket)
            limit = cap if key in closed else min(cap, FIRST_BUCKET_BYTES)
            if bucket.nbytes + nbytes >= limit:      # it closes after this parameter
                del open_buckets[key]
                closed.add(key)
        bucket.params.append(p)
        bucket.nbytes += nbytes
    cast_only = hasattr(compression, "wire_dtype")
    for bucket in buckets:
        first = bucket.params[0]
        if hasattr(compression, "wire_dtype"):      # cast_only, written so that mypy narrows
            dtype = compression.wire_dtype(first.dtype)
        else:
            dtype = compression.compress(first.new_zeros(1))[0].dtype
        bucket.cast_only = cast_only
        bucket.as_view = as_view and dtype == first.dtype
        bucket.flat = torch.zeros(sum(p.numel() for p in bucket.params), dtype=dtype,
                                  device=first.device)
        offset = 0
        for p in bucket.params:
            bucket.views.append(bucket.flat[offset: offset + p.numel()].view(p.shape))
            bucket.ctxs.append(None)
            offset += p.numel()
        if not bucket.as_view:
            bucket.loose = list(bucket.params)
    return buckets


def zero_grad(p: torch.Tensor, set_to_none: bool) -> None:
    """Optimizer.zero_grad for one parameter, as torch does it."""
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
        return
    if p.grad.grad_fn is not None:
        p.grad.detach_()
    else:
        p.grad.requires_grad_(False)
    p.grad.zero_()


def detach_views(buckets: Iterable[Bucket] | None, keep: bool) -> None:
    """Gradients that are views into ``buckets``' buffers stop being views, because
    those buffers are given up (only on a rebuild or a failure, never per step).

    ``keep``: no work is in flight, so each keeps what it accumulated (micro-batches
    run inside ``no_sync()`` before the round changed) and the next hook copies it
    into the new buffers. Otherwise it becomes None: abandoned work may still
    write into the old buffer.
    """
    for bucket in buckets or ():
        if bucket.as_view:
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is view:
                    p.grad = view.clone() if keep else None



def launch_bucket(process_set: ReducingSet | None, flat: torch.Tensor, op: str,
                  predivide: float) -> tuple[tuple | None, int]:
    """Start a bucket's allreduce over the round, or over a ProcessSet's members; returns
    (handle, bytes sent). A rank outside the set gets (None, 0): its gradients stay its
    own. ``predivide`` (gradient_predivide_factor) divides before the sum."""
    reduce_async: Callable[[torch.Tensor, str], tuple | None]
    if process_set is None or process_set.process_set_id == 0:
        reduce_async = collectives.allreduce_async
    elif process_set.included():
        reduce_async = process_set.reduce_async
    else:
        return process_set.reduce_async(flat, op), 0   # None; raises if the set is stale
    if predivide != 1.0:
        flat.div_(predivide)
    return reduce_async(flat, op), flat.numel() * flat.element_size()
