"""elastic: data-parallel PyTorch training that gains and loses workers while it runs."""

from .checkpoint import Checkpointer
from .collectives import (
    Average, Max, Min, Product, ReduceOp, Sum, allgather, allgather_object, allreduce,
    allreduce_, barrier, broadcast, broadcast_, broadcast_object, broadcast_optimizer_state,
    broadcast_parameters,
)
from .exceptions import ElasticError, HostsUpdatedInterrupt, WorkersDepartedError
from .global_batch import GlobalBatch, MicroBatch
from .launch import LaunchError, launch
from .lr_scaling import LRScaler
from .optimizer import Compression, DistributedOptimizer
from .progress import report_progress
from .run_loop import run
from .runtime import (
    cross_rank, cross_size, init, is_initialized, local_rank, local_size, rank, shutdown, size,
)
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState

__version__ = "0.1.0"

__all__ = [
    "Average", "Max", "Min", "Product", "ReduceOp", "Sum", "allgather", "allgather_object",
    "allreduce", "allreduce_", "barrier", "broadcast", "broadcast_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ElasticError", "HostsUpdatedInterrupt",
    "WorkersDepartedError", "run", "cross_rank", "cross_size", "init", "is_initialized",
    "local_rank", "local_size", "rank", "shutdown", "size", "ElasticSampler", "ObjectState",
    "State", "TorchState", "report_progress", "Compression", "DistributedOptimizer",
    "LRScaler", "GlobalBatch", "MicroBatch", "Checkpointer", "launch", "LaunchError",
]
