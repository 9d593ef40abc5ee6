"""elastic: data-parallel PyTorch training that gains and loses workers while it runs."""

from elastic.checkpoint.checkpointer import Checkpointer
from elastic.exceptions import ElasticError, HostsUpdatedInterrupt, WorkersDepartedError
from elastic.launching.client import LaunchError, launch
from elastic.state.sharded import ShardedState
from elastic.state.states import ObjectState, State, TorchState
from elastic.training.ddp import DDP, DistributedDataParallel
from elastic.training.global_batch import GlobalBatch, MicroBatch
from elastic.training.lr_scaling import LRScaler
from elastic.training.optimizer import Compression, DistributedOptimizer
from elastic.training.progress import report_progress
from elastic.training.sampler import ElasticSampler
from elastic.worker.collectives import (
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from elastic.worker.run_loop import run
from elastic.worker.runtime import (
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)

__version__ = "0.1.0"

__all__ = [
    "Average", "Max", "Min", "Product", "ReduceOp", "Sum", "allgather", "allgather_object",
    "allreduce", "allreduce_", "barrier", "broadcast", "broadcast_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ElasticError", "HostsUpdatedInterrupt",
    "WorkersDepartedError", "run", "cross_rank", "cross_size", "init", "is_initialized",
    "local_rank", "local_size", "rank", "shutdown", "size", "ElasticSampler", "ObjectState",
    "State", "TorchState", "ShardedState", "report_progress", "Compression", "DistributedOptimizer",
    "LRScaler", "GlobalBatch", "MicroBatch", "Checkpointer", "launch", "LaunchError",
    "DistributedDataParallel", "DDP",
]
