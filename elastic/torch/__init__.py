"""Horovod's PyTorch names, so a script ports with one changed import line:

    import horovod.torch as hvd   ->   import elastic.torch as hvd
"""

from elastic.exceptions import HostsUpdatedInterrupt, WorkersDepartedError
from elastic.torch import elastic  # noqa: F401  (hvd.elastic.run, hvd.elastic.TorchState, ...)
from elastic.torch.handles import poll, synchronize
from elastic.torch.move_ops import allgather_object, barrier, broadcast_object
from elastic.torch.negotiation import CollectiveMismatchError
from elastic.torch.ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
)
from elastic.torch.process_sets import (
    ProcessSet,
    ProcessSetStaleError,
    add_process_set,
    global_process_set,
    init,
    remove_process_set,
)
from elastic.torch.queries import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from elastic.torch.reduce_ops import Adasum, join
from elastic.torch.state_broadcast import broadcast_optimizer_state
from elastic.torch.sync_batch_norm import SyncBatchNorm
from elastic.training.optimizer import Compression, DistributedOptimizer
from elastic.worker import collectives as _c
from elastic.worker import runtime as _rt

__all__ = [
    "Adasum", "Average", "CollectiveMismatchError", "Compression", "DistributedOptimizer",
    "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min", "ProcessSet",
    "ProcessSetStaleError", "Product", "ReduceOp", "Sum", "SyncBatchNorm", "add_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]

HorovodInternalError = WorkersDepartedError
Average, Sum, Min, Max, Product = _c.Average, _c.Sum, _c.Min, _c.Max, _c.Product
ReduceOp = _c.ReduceOp

shutdown, is_initialized = _rt.shutdown, _rt.is_initialized
rank, size, local_rank, local_size = _rt.rank, _rt.size, _rt.local_rank, _rt.local_size
cross_rank, cross_size = _rt.cross_rank, _rt.cross_size
broadcast_parameters = _c.broadcast_parameters
