"""Horovod's PyTorch names, so a script ports with one changed import line:

    import horovod.torch as hvd   ->   import elastic.torch as hvd
"""

from elastic.exceptions import HostsUpdatedInterrupt, WorkersDepartedError
from elastic.torch import elastic  # noqa: F401  (hvd.elastic.run, hvd.elastic.TorchState, ...)
from elastic.training.optimizer import Compression, DistributedOptimizer
from elastic.worker import collectives as _c
from elastic.worker import runtime as _rt

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "DistributedOptimizer", "Compression", "broadcast_parameters",
    "broadcast_optimizer_state", "broadcast_object", "allgather_object", "barrier", "allreduce",
    "allreduce_", "allgather", "broadcast", "broadcast_", "elastic", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Average", "Sum", "Min", "Max", "Product", "ReduceOp",
]

HorovodInternalError = WorkersDepartedError
Average, Sum, Min, Max, Product = _c.Average, _c.Sum, _c.Min, _c.Max, _c.Product
ReduceOp = _c.ReduceOp

init, shutdown, is_initialized = _rt.init, _rt.shutdown, _rt.is_initialized
rank, size, local_rank, local_size = _rt.rank, _rt.size, _rt.local_rank, _rt.local_size
cross_rank, cross_size = _rt.cross_rank, _rt.cross_size
broadcast_parameters, broadcast_optimizer_state = _c.broadcast_parameters, _c.broadcast_optimizer_state
broadcast_object, allgather_object, barrier = _c.broadcast_object, _c.allgather_object, _c.barrier


def _op(average, op):
    if op is not None:
        return op
    return Sum if average is False else Average


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0):
    """Horovod's signature; ``name`` is accepted and ignored (no negotiation here)."""
    wire, ctx = compression.compress(tensor.detach().clone() * prescale_factor)
    out = compression.decompress(_c.allreduce_(wire, _op(average, op)), ctx)
    return out * postscale_factor if postscale_factor != 1.0 else out


def allreduce_(tensor, average=None, name=None, op=None):
    return _c.allreduce_(tensor, _op(average, op))


def allgather(tensor, name=None):
    return _c.allgather(tensor)


def broadcast(tensor, root_rank, name=None):
    return _c.broadcast(tensor, root_rank)


def broadcast_(tensor, root_rank, name=None):
    return _c.broadcast_(tensor, root_rank)
