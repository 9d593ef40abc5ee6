"""``horovod.torch``'s collectives, with its signatures, names and gradients.

Out-of-place ops are differentiable as Horovod defines them: allreduce's
gradient is the allreduce of the gradient (same op and scale factors);
allgather's is this rank's slice of the averaged gradient; broadcast's is the
averaged gradient on the root and zero elsewhere; alltoall's is the alltoall of
the gradient back; reducescatter's is the allgather of the gradient, times the
set's size for Sum, times the scale factors. In-place (``*_``) and async ops
are not tracked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from elastic.torch import move_ops, reduce_ops
from elastic.torch.errors import UnsupportedOpError
from elastic.torch.handles import Handle
from elastic.torch.process_sets import ProcessSet, global_process_set
from elastic.torch.reduce_ops import Average, Sum, resolve_op
from elastic.training.optimizer import Compression
from elastic.worker import runtime

if TYPE_CHECKING:
    from elastic.torch.move_ops import Splits
    from elastic.training.compression import Compressor

_GLOBAL = global_process_set


class _Single(Handle):
    """An async handle whose result is the single tensor of a one-tensor op."""

    def __init__(self, inner: Handle) -> None:
        super().__init__()
        self._inner = inner

    def poll(self) -> bool:
        return self._inner.poll()

    def wait(self) -> Any:
        return self._inner.wait()[0]


_one = _Single


# -- allreduce ---------------------------------------------------------------------------
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None,
                     name: str | None = None, op: str | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet | None = _GLOBAL) -> Handle:
    return _one(reduce_ops.allreduce_async_([tensor], resolve_op(average, op), prescale_factor,
                                            postscale_factor, name, process_set,
                                            deferrable=True))


def allreduce_async(tensor: torch.Tensor, average: bool | None = None,
                    name: str | None = None, op: str | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet | None = _GLOBAL) -> Handle:
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor,
                            postscale_factor, process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None,
               name: str | None = None, op: str | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet | None = _GLOBAL) -> torch.Tensor:
    return reduce_ops.allreduce_async_([tensor], resolve_op(average, op), prescale_factor,
                                       postscale_factor, name, process_set).wait()[0]


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, pre, post, name, process_set, *tensors):
        ctx.args = (op, pre, post, process_set)
        outs = [t.detach().clone() for t in tensors]
        return tuple(reduce_ops.allreduce_async_(outs, op, pre, post, name, process_set).wait())

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        grads = [g.contiguous() for g in grads]
        reduced = reduce_ops.allreduce_async_([g.clone() for g in grads], op, pre, post, None,
                                              process_set).wait()
        return (None,) * 5 + tuple(reduced)


def allreduce(tensor: torch.Tensor, average: bool | None = None,
              name: str | None = None, compression: Compressor = Compression.none,
              op: str | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0,
              process_set: ProcessSet | None = _GLOBAL) -> torch.Tensor:
    op = resolve_op(average, op)
    wire, ctx = compression.compress(tensor)
    (out,) = _Allreduce.apply(op, prescale_factor, postscale_factor, name, process_set, wire)
    return compression.decompress(out, ctx)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet | None = _GLOBAL) -> Handle:
    return reduce_ops.allreduce_async_(list(tensors), resolve_op(average, op), prescale_factor,
                                       postscale_factor, name, process_set,
                                       kind="grouped_allreduce", deferrable=True)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet | None = _GLOBAL) -> Handle:
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name, op,
                                    prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet | None = _GLOBAL) -> list[torch.Tensor]:
    return reduce_ops.allreduce_async_(list(tensors), resolve_op(average, op), prescale_factor,
                                       postscale_factor, name, process_set,
                                       kind="grouped_allreduce").wait()


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Compressor = Compression.none,
                      op: str | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet | None = _GLOBAL) -> list[torch.Tensor]:
    op = resolve_op(average, op)
    wires = [compression.compress(t) for t in tensors]
    outs = _Allreduce.apply(op, prescale_factor, postscale_factor, name, process_set,
                            *[w for w, _ in wires])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, wires)]


class _Sparse(Handle):
    """Two allgathers in flight (indices, values); the result is their coalesced sum."""

    def __init__(self, indices, values, finish):
        super().__init__(finish=finish)
        self._parts = (indices, values)

    def poll(self):
        return all(part.poll() for part in self._parts)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: str | None,
                           process_set: ProcessSet | None = _GLOBAL) -> Handle:
    """Allreduce of a sparse tensor: allgather indices and values (named ``<name>.indices``
    and ``<name>.values``, as in Horovod), then coalesce, which sums repeated indices.
    ``synchronize(handle)`` and ``handle()`` both give the result."""
    op = resolve_op(None, op)
    if op not in (Average, Sum):
        raise UnsupportedOpError(f"sparse allreduce supports Average and Sum, not {op!r}")
    t = tensor.coalesce()
    indices = move_ops.allgather_async([t.indices().t().contiguous()], _part(name, "indices"),
                                       process_set, deferrable=True)
    values = move_ops.allgather_async([t.values()], _part(name, "values"), process_set,
                                      deferrable=True)

    def finish():
        idx, vals = indices.wait()[0], values.wait()[0]
        if op == Average:
            vals = vals / (1 if process_set is None else process_set.size())
        return torch.sparse_coo_tensor(idx.t(), vals, t.shape).coalesce()

    return _Sparse(indices, values, finish)


def _part(name: str | None, what: str) -> str | None:
    return None if name is None else f"{name}.{what}"


# -- allgather ---------------------------------------------------------------------------
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet | None = _GLOBAL) -> Handle:
    return _one(move_ops.allgather_async([tensor], name, process_set, deferrable=True))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet | None = _GLOBAL) -> Handle:
    return move_ops.allgather_async(list(tensors), name, process_set, deferrable=True)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        handle = move_ops.allgather_async(list(tensors), name, process_set)
        outs = handle.wait()
        ctx.process_set = process_set
        rank = max(process_set.rank(), 0)
        ctx.slices = []
        for t, sizes in zip(tensors, getattr(handle, "dim0s", [[t.shape[0] if t.dim() else 1]
                                                              for t in tensors])):
            ctx.slices.append((sum(sizes[:rank]), sizes[rank] if sizes else 0, t.dim() == 0))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        averaged = reduce_ops.allreduce_async_([g.contiguous().clone() for g in grads], Average,
                                               process_set=ctx.process_set).wait()
        out = []
        for g, (start, n, scalar) in zip(averaged, ctx.slices):
            piece = g[start:start + n]
            out.append(piece.reshape(()) if scalar else piece)
        return (None, None) + tuple(out)


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet | None = _GLOBAL) -> torch.Tensor:
    return _Allgather.apply(name, process_set, tensor)[0]


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet | None = _GLOBAL) -> list[torch.Tensor]:
    return list(_Allgather.apply(name, process_set, *tensors))


# -- broadcast ---------------------------------------------------------------------------
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet | None = _GLOBAL) -> Handle:
    return move_ops.broadcast_async_(tensor, root_rank, name, process_set, deferrable=True)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet | None = _GLOBAL) -> Handle:
    return move_ops.broadcast_async_(tensor.detach().clone(), root_rank, name, process_set,
                                     deferrable=True)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = _GLOBAL) -> torch.Tensor:
    return move_ops.broadcast_async_(tensor, root_rank, name, process_set).wait()


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return move_ops.broadcast_async_(tensor.detach().clone(), root_rank, name,
                                         process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        (averaged,) = reduce_ops.allreduce_async_([grad.contiguous().clone()], Average,
                                                  process_set=ctx.process_set).wait()
        if runtime.rank() != ctx.root_rank:
            averaged.zero_()
        return averaged, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet | None = _GLOBAL) -> torch.Tensor:
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# -- alltoall ----------------------------------------------------------------------------
def alltoall_async(tensor: torch.Tensor, splits: Splits = None, name: str | None = None,
                   process_set: ProcessSet | None = _GLOBAL) -> Handle:
    """synchronize() gives (output, received_splits), as in Horovod."""
    return move_ops.alltoall_async(tensor, splits, name, process_set, deferrable=True)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = move_ops.alltoall_async(tensor, splits, name, process_set).wait()
        ctx.process_set, ctx.received = process_set, received
        ctx.dim0 = tensor.shape[0]
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _grad_splits):
        back, _ = move_ops.alltoall_async(grad.contiguous(), ctx.received, None,
                                          ctx.process_set).wait()
        if back.shape[0] < ctx.dim0:     # rows that were never sent get no gradient
            back = torch.cat([back, back.new_zeros((ctx.dim0 - back.shape[0],)
                                                   + tuple(back.shape[1:]))])
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Splits = None, name: str | None = None,
             process_set: ProcessSet | None = _GLOBAL) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The rows for this rank from every rank; with ``splits``, also the received splits."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# -- reducescatter -----------------------------------------------------------------------
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: str = Average,
                        process_set: ProcessSet | None = _GLOBAL, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    return _one(reduce_ops.reducescatter_async([tensor], op, prescale_factor, postscale_factor,
                                               name, process_set, deferrable=True))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: str = Average, process_set: ProcessSet | None = _GLOBAL,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    return reduce_ops.reducescatter_async(list(tensors), op, prescale_factor, postscale_factor,
                                          name, process_set, deferrable=True)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, pre, post, name, process_set, *tensors):
        ctx.args = (op, pre * post, process_set)
        return tuple(reduce_ops.reducescatter_async(list(tensors), op, pre, post, name,
                                                    process_set).wait())

    @staticmethod
    def backward(ctx, *grads):
        op, factor, process_set = ctx.args
        gathered = move_ops.allgather_async([g.contiguous() for g in grads], None,
                                            process_set).wait()
        if op == Sum:
            factor *= 1 if process_set is None else process_set.size()
        return (None,) * 5 + tuple(g * factor if factor != 1.0 else g for g in gathered)


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: Compressor = Compression.none, op: str = Average,
                  process_set: ProcessSet | None = _GLOBAL, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    wire, ctx = compression.compress(tensor)
    (out,) = _Reducescatter.apply(op, prescale_factor, postscale_factor, name, process_set, wire)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Compressor = Compression.none, op: str = Average,
                          process_set: ProcessSet | None = _GLOBAL, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    wires = [compression.compress(t) for t in tensors]
    outs = _Reducescatter.apply(op, prescale_factor, postscale_factor, name, process_set,
                                *[w for w, _ in wires])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, wires)]
