"""Constant-global-batch training: every optimizer step sees the same G samples,
whatever the world size.

The sampler cuts each epoch into global batches of ``G`` samples (the same at any
world size) and deals each one round-robin to the current ranks, so shares differ
by at most one sample. Each rank runs its share in micro-batches, accumulating
gradients locally (``DistributedOptimizer.no_sync()``) until the last one, whose
backward pass launches the allreduce. Each micro-batch loss is weighted by its
share of the global batch, so the reduced gradient is exactly

    (1/G) * sum over the G samples of grad(loss_i)

however unevenly the batch was split. With the optimizer's default
``op=Average``, which divides by the world size ``s``, a micro-batch of ``n``
samples whose loss is a mean gets weight ``n * s / G``; with ``op=Sum`` it gets
``n / G``. A rank whose share is empty (G smaller than the world) still calls
``optimizer.step()`` and contributes zeros.

    sampler = elastic.ElasticSampler(dataset, global_batch_size=256)
    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @elastic.run
    def train(state):
        while state.epoch < epochs:
            state.sampler.set_epoch(state.epoch)
            for batch in state.sampler.global_batches(optimizer, micro_batch_size=32):
                optimizer.zero_grad()
                for micro in batch:                      # this rank's share
                    x, y = collate(micro.indices)
                    micro.backward(loss_fn(model(x), y)) # loss: mean over the micro-batch
                optimizer.step()                         # gradient: mean over all G samples
                state.sampler.record_global_batch()
                state.commit()
            state.epoch += 1
            state.commit()

Keep the learning rate fixed in this mode (no LRScaler): the global batch does
not change. Results match a fixed-size run up to floating-point summation order,
provided the model treats samples independently (BatchNorm statistics, for one,
depend on how samples are grouped into micro-batches).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from elastic.worker import runtime
from elastic.worker.collectives import ReduceOp

if TYPE_CHECKING:
    import torch

    from elastic.training.sampler import ElasticSampler


class MicroBatch:
    """Part of this rank's share of a global batch, small enough for one forward pass."""

    __slots__ = ("indices", "weight", "last", "_scale", "_optimizer")

    def __init__(self, indices: list[int], scale: float, last: bool, optimizer: object) -> None:
        self.indices = indices
        self._scale = scale                  # world-size factor / G
        self.weight = len(indices) * scale   # for a loss that is a mean over the micro-batch
        self.last = last                     # its backward pass launches the allreduce
        self._optimizer = optimizer

    def __len__(self) -> int:
        return len(self.indices)

    def scale(self, loss: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """``loss`` weighted by this micro-batch's share of the global batch.

        ``reduction``: ``"mean"`` if ``loss`` averages over the micro-batch's samples,
        ``"sum"`` if it adds them up."""
        if reduction == "mean":
            return loss * self.weight
        if reduction == "sum":
            return loss * self._scale
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")

    def backward(self, loss: torch.Tensor, reduction: str = "mean", **kwargs: Any) -> None:
        """Backward of the weighted loss; all but the last micro-batch accumulate locally."""
        weighted = self.scale(loss, reduction)
        no_sync = getattr(self._optimizer, "no_sync", None)
        if self.last or no_sync is None:
            weighted.backward(**kwargs)
        else:
            with no_sync():
                weighted.backward(**kwargs)


class GlobalBatch:
    """One optimizer step's worth of samples, as this rank sees it.

    ``global_indices``: all ``G`` dataset indices of the step (the same on every rank);
    ``indices``: this rank's share; iterating yields its :class:`MicroBatch` es;
    ``number``: how many batches this iteration yielded before it; ``size``: ``G``.
    """

    def __init__(self, number: int, global_indices: list[int], indices: list[int],
                 micro_batch_size: int | None, scale: float, optimizer: object) -> None:
        self.number = number
        self.global_indices = global_indices
        self.indices = indices
        self.size = len(global_indices)
        step = micro_batch_size or max(1, len(indices))
        chunks = [indices[i:i + step] for i in range(0, len(indices), step)]
        self.micro_batches = [MicroBatch(c, scale, i == len(chunks) - 1, optimizer)
                              for i, c in enumerate(chunks)]
        self._owner = optimizer

    def __iter__(self) -> Iterator[MicroBatch]:
        # torch's DDP decides at the forward pass whether the backward reduces, so an
        # elastic.DDP owner is told before each micro-batch's forward (and reset after).
        sync_backward = getattr(self._owner, "sync_backward", None)
        if sync_backward is None:
            yield from self.micro_batches
            return
        try:
            for micro in self.micro_batches:
                sync_backward(micro.last)
                yield micro
        finally:
            sync_backward(True)

    def __len__(self) -> int:
        return len(self.micro_batches)


def world_scale(optimizer: object) -> float:
    """The factor that turns 'share of the global batch' into a loss weight: the world
    size when the optimizer averages across ranks, 1 when it sums."""
    op = getattr(optimizer, "op", None)
    size = runtime.size()
    if op is None:  # a plain torch optimizer reduces nothing: only right on its own
        if size != 1:
            raise TypeError("global-batch mode needs an elastic.DistributedOptimizer when "
                            f"the world has {size} workers")
        return 1
    if op == ReduceOp.Average:
        return size
    if op == ReduceOp.Sum:
        return 1
    raise ValueError(f"global-batch mode needs op=Average or op=Sum, not {op!r}")


def iterate_global_batches(sampler: ElasticSampler, optimizer: object,
                           micro_batch_size: int | None = None) -> Iterator[GlobalBatch]:
    """The generator behind ``ElasticSampler.global_batches``."""
    g = sampler.global_batch_size
    if not g:
        raise ValueError("global_batches() needs ElasticSampler(..., global_batch_size=G)")
    if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or
                                         not isinstance(micro_batch_size, int) or
                                         micro_batch_size < 1):
        raise ValueError(f"micro_batch_size must be an int >= 1 or None, not {micro_batch_size!r}")
    number = 0
    while sampler.global_batches_left > 0:
        if runtime.ensure_joined() is not None and (runtime.rank(), runtime.size()) != (
                sampler.rank, sampler.size):
            raise RuntimeError(
                f"the sampler splits batches for rank {sampler.rank} of {sampler.size} but this "
                f"is rank {runtime.rank()} of {runtime.size()}: pass it to elastic.TorchState "
                "so that membership changes reset it")
        start = sampler.processed_num
        global_indices = sampler.global_batch_indices(0)
        share = sampler.share_of(global_indices)
        yield GlobalBatch(number, global_indices, share, micro_batch_size,
                          world_scale(optimizer) / g, optimizer)
        if sampler.processed_num != min(sampler.length, start + g):
            raise RuntimeError("call sampler.record_global_batch() once after each optimizer "
                               "step of global-batch mode, before the next batch")
        number += 1
