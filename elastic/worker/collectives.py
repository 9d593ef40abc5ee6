"""Collectives that never wait without bound.

Each one is issued with async work on the current round's group and waited
on in short slices that watch the driver's abort key (waiting.py). Any failure of
torch.distributed surfaces as WorkersDepartedError, which the run loop turns
into restore-and-rejoin. Outside elasticrun (size 1) they are identities.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

from elastic.worker import runtime
from elastic.worker.waiting import issue as _issue
from elastic.worker.waiting import wait


class ReduceOp:
    """Horovod-style op names mapped onto torch's."""

    Average = "average"
    Sum = "sum"
    Min = "min"
    Max = "max"
    Product = "product"


Average, Sum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Min,
                                   ReduceOp.Max, ReduceOp.Product)

_TORCH_OPS = {
    ReduceOp.Average: dist.ReduceOp.SUM, ReduceOp.Sum: dist.ReduceOp.SUM,
    ReduceOp.Min: dist.ReduceOp.MIN, ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}


def _active_worker():
    return runtime.ensure_joined()


def _group_for(w, tensor):
    return w.device_group if tensor.is_cuda else w.cpu_group


def allreduce_async(tensor: torch.Tensor, op: str = Average) -> tuple | None:
    """Start an in-place allreduce; returns a handle for synchronize(), or None at size 1."""
    w = _active_worker()
    if w is None:
        return None
    opts = dist.AllreduceOptions()
    opts.reduceOp = _TORCH_OPS[op]  # type: ignore[assignment]
    work = _issue(lambda: _group_for(w, tensor).allreduce([tensor], opts), "allreduce")
    w.progress.issue()     # gradient hooks issue these during backward: that is progress too
    return (work, tensor, op, w.membership.size, w)


def synchronize(handle: tuple | None) -> None:
    if handle is None:
        return
    work, tensor, op, world, w = handle
    wait(work, "allreduce", w)
    if op == Average:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(world)
        else:
            tensor.div_(world, rounding_mode="floor")


def allreduce_(tensor: torch.Tensor, op: str = Average) -> torch.Tensor:
    synchronize(allreduce_async(tensor, op))
    return tensor


def allreduce(tensor: torch.Tensor, op: str = Average) -> torch.Tensor:
    """Out-of-place allreduce, as in Horovod."""
    return allreduce_(tensor.detach().clone(), op)


def allgather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dims may differ)."""
    w = _active_worker()
    if w is None:
        return tensor.detach().clone()
    size = w.membership.size
    lengths = torch.zeros(size, dtype=torch.int64)
    lengths[w.membership.rank] = tensor.shape[0] if tensor.dim() else 1
    allreduce_(lengths, Sum)
    longest = int(lengths.max())
    padded = tensor.new_zeros((longest,) + tuple(tensor.shape[1:]))
    if tensor.dim():
        padded[: tensor.shape[0]] = tensor
    else:
        padded = tensor.reshape(1).clone()
    outputs = [torch.empty_like(padded) for _ in range(size)]
    group = _group_for(w, tensor)
    wait(_issue(lambda: group.allgather([outputs], [padded]), "allgather"), "allgather", w)
    return torch.cat([out[: int(n)] for out, n in zip(outputs, lengths)])


def broadcast_(tensor: torch.Tensor, root_rank: int = 0) -> torch.Tensor:
    w = _active_worker()
    if w is None:
        return tensor
    opts = dist.BroadcastOptions()
    opts.rootRank = root_rank
    opts.rootTensor = 0
    group = _group_for(w, tensor)
    wait(_issue(lambda: group.broadcast([tensor], opts), "broadcast"), "broadcast", w)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int = 0) -> torch.Tensor:
    return broadcast_(tensor.detach().clone(), root_rank)


def barrier() -> None:
    allreduce_(torch.zeros(1), Sum)


def _to_bytes(obj):
    buf = io.BytesIO()
    pickle.dump(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """Pickle over the data plane, which, like torch.distributed's, is trusted."""
    w = _active_worker()
    if w is None:
        return obj
    is_root = w.membership.rank == root_rank
    payload = _to_bytes(obj) if is_root else torch.empty(0, dtype=torch.uint8)
    length = broadcast_(torch.tensor([payload.numel()], dtype=torch.int64), root_rank)
    if not is_root:
        payload = torch.empty(int(length), dtype=torch.uint8)
    broadcast_(payload, root_rank)
    return obj if is_root else pickle.loads(payload.numpy().tobytes())


def allgather_object(obj: Any) -> list:
    gathered = allgather(_to_bytes(obj))
    lengths = allgather(torch.tensor([_to_bytes(obj).numel()], dtype=torch.int64))
    out, offset = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(gathered[offset: offset + n].numpy().tobytes()))
        offset += n
    return out


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Accepts a state_dict, named_parameters() or a list of (name, tensor)."""
    items = params.items() if hasattr(params, "items") else params
    for _name, tensor in sorted(items, key=lambda kv: kv[0]):
        if torch.is_tensor(tensor):
            with torch.no_grad():
                broadcast_(tensor.data if hasattr(tensor, "data") else tensor, root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Ship the root's state_dict; ranks without optimizer state get it created from it."""
    state = broadcast_object(optimizer.state_dict(), root_rank)
    if _active_worker() is not None and runtime.rank() != root_rank:
        optimizer.load_state_dict(state)
