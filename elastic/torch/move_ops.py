"""Ops that move data without arithmetic: allgather, broadcast, alltoall, barrier, join.

Dtypes that gloo cannot carry (int16, complex for gathers) travel as their raw
bytes, so every dtype keeps its exact bits. Root ranks are global ranks and
must belong to the process set.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

import torch
import torch.distributed as dist

from elastic.torch import matching, negotiation
from elastic.torch.handles import Handle, claim_name
from elastic.torch.negotiation import (
    ALLGATHER,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    CollectiveMismatchError,
    record,
)
from elastic.torch.process_sets import bind
from elastic.worker import collectives

if TYPE_CHECKING:
    from elastic.torch.process_sets import Binding, ProcessSet

Splits = Union[Sequence[int], torch.Tensor, None]    # alltoall's rows per destination rank
_CARRIED = {torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
            torch.float32, torch.float64, torch.bool}


def _rows(tensor):
    """A 2-D view (rows, row elements) of a contiguous tensor, as bytes if gloo needs that."""
    t = tensor.reshape(1) if tensor.dim() == 0 else tensor
    if t.dtype not in _CARRIED:
        t = t.reshape(-1).view(torch.uint8)
    return t.reshape(tensor.shape[0] if tensor.dim() else 1, -1)


def _from_rows(rows, like, dim0):
    if like.dtype not in _CARRIED:
        rows = rows.reshape(-1).view(like.dtype)
    return rows.reshape((dim0,) + tuple(like.shape[1:]))


def _issue(binding, tensor, what, fn):
    group = binding.group_for(tensor)
    return negotiation.issue(lambda: fn(group), what)


# -- allgather ---------------------------------------------------------------------------
def allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                    process_set: ProcessSet | None = None, deferrable: bool = False) -> Handle:
    """Concatenate each tensor's values from every rank along dim 0 (dim 0 may differ)."""
    binding = bind(process_set)
    name_key = claim_name("allgather", name)
    if binding is None or binding.size == 1:
        return Handle(name_key=name_key, finish=lambda: [t.detach().clone() for t in tensors])
    inputs = [t.detach().contiguous() for t in tensors]

    def issue(outcome):
        if len(inputs) == 1:
            dim0s = [outcome.dim0s()]
        else:
            mine = torch.tensor([t.shape[0] if t.dim() else 1 for t in inputs],
                                dtype=torch.int64)
            dim0s = [[int(x) for x in col] for col in
                     torch.stack(_gather_equal(binding, mine)).t()]
        works, pieces = [], []
        for t, sizes in zip(inputs, dim0s):
            rows = _rows(t)
            longest = max(sizes)
            if rows.shape[0] < longest:
                rows = torch.cat([rows, rows.new_zeros((longest - rows.shape[0],
                                                        rows.shape[1]))])
            outputs = [torch.empty_like(rows) for _ in range(binding.size)]
            works.append(_issue(binding, rows, "allgather",
                                lambda g, o=outputs, r=rows: g.allgather([o], [r])))
            pieces.append((outputs, sizes, t))

        def finish():
            out = []
            for outputs, sizes, like in pieces:
                rows = torch.cat([o[:n] for o, n in zip(outputs, sizes)])
                out.append(_from_rows(rows, like, sum(sizes)))
            return out

        handle = Handle(works, finish, binding.worker, name_key, what="allgather")
        handle.dim0s = dim0s
        return handle

    rec = record(ALLGATHER, inputs, name=name, vary_dim0=True)
    return matching.start(binding, rec, "allgather", issue, name_key, vary_dim0=True,
                          deferrable=deferrable)


def _gather_equal(binding, tensor):
    outputs = [torch.empty_like(tensor) for _ in range(binding.size)]
    work = _issue(binding, tensor, "allgather", lambda g: g.allgather([outputs], [tensor]))
    collectives.wait(work, "allgather", binding.worker)
    return outputs


# -- broadcast ---------------------------------------------------------------------------
def _set_root(binding, root_rank):
    if binding is None:
        if root_rank != 0:
            raise ValueError(f"root_rank {root_rank} is out of range for a job of size 1")
        return 0
    if root_rank not in binding.ranks:
        raise ValueError(f"root_rank {root_rank} is not a rank of the process set "
                         f"{binding.ranks}")
    return binding.ranks.index(root_rank)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet | None = None, deferrable: bool = False) -> Handle:
    """Overwrite ``tensor`` with the root's values; the handle's result is ``tensor``."""
    binding = bind(process_set)
    root = _set_root(binding, int(root_rank))
    name_key = claim_name("broadcast", name)
    if binding is None or binding.size == 1:
        return Handle(name_key=name_key, finish=lambda: tensor)

    def issue(outcome):
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        rows = _rows(buf)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        work = _issue(binding, rows, "broadcast", lambda g: g.broadcast([rows], opts))

        def finish():
            if buf is not tensor:
                tensor.copy_(buf)
            return tensor

        return Handle([work], finish, binding.worker, name_key, what="broadcast")

    rec = record(BROADCAST, [tensor], root=int(root_rank), name=name)
    return matching.start(binding, rec, "broadcast", issue, name_key, deferrable=deferrable)


# -- alltoall ----------------------------------------------------------------------------
def _checked_splits(tensor, splits, size):
    dim0 = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if tensor.dim() == 0 or dim0 % size:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by "
                             f"the {size} ranks, got shape {list(tensor.shape)}")
        return [dim0 // size] * size
    if torch.is_tensor(splits):
        if splits.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"alltoall splits must be int32 or int64, not {splits.dtype}")
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != size or any(s < 0 for s in splits):
        raise ValueError(f"alltoall needs {size} non-negative splits, got {splits}")
    if sum(splits) > dim0:
        raise ValueError(f"alltoall splits {splits} sum to more than the first dimension "
                         f"({dim0})")
    return splits


def alltoall_async(tensor: torch.Tensor, splits: Splits = None, name: str | None = None,
                   process_set: ProcessSet | None = None, deferrable: bool = False) -> Handle:
    """Send rows ``splits[i]`` to rank i; the result is (output, received splits)."""
    binding = bind(process_set)
    size = 1 if binding is None else binding.size
    sends = _checked_splits(tensor, splits, size)
    name_key = claim_name("alltoall", name)
    if binding is None or binding.size == 1:
        out = tensor.detach()[:sends[0]].clone()
        return Handle(name_key=name_key,
                      finish=lambda: (out, torch.tensor(sends, dtype=torch.int32)))
    inputs = tensor.detach().contiguous()

    def issue(outcome):
        matrix = torch.stack(_gather_equal(binding, torch.tensor(sends, dtype=torch.int64)))
        received = [int(x) for x in matrix[:, binding.rank]]
        rows = _rows(inputs[:sum(sends)])
        output = rows.new_empty((sum(received), rows.shape[1]))
        work = _issue(binding, rows, "alltoall", lambda g: g.alltoall_base(
            output, rows, received, sends, dist.AllToAllOptions()))

        def finish():
            return (_from_rows(output, inputs, sum(received)),
                    torch.tensor(received, dtype=torch.int32))

        return Handle([work], finish, binding.worker, name_key, what="alltoall")

    rec = record(ALLTOALL, [inputs], name=name, vary_dim0=True)
    return matching.start(binding, rec, "alltoall", issue, name_key, vary_dim0=True,
                          deferrable=deferrable)


# -- objects, barrier, join --------------------------------------------------------------
def _dumps(obj):
    buf = io.BytesIO()
    pickle.dump(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def broadcast_object_on(binding: Binding, obj: Any, root: int) -> Any:
    """Pickle ``obj`` from set rank ``root`` over the set's CPU group (a trusted data plane)."""
    payload = _dumps(obj) if binding.rank == root else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    for t in (length, None):
        if t is None:
            if binding.rank != root:
                payload = torch.empty(int(length), dtype=torch.uint8)
            t = payload
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        work = _issue(binding, t, "broadcast_object", lambda g, t=t, opts=opts: g.broadcast([t], opts))
        collectives.wait(work, "broadcast_object", binding.worker)
    return obj if binding.rank == root else pickle.loads(payload.numpy().tobytes())


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Any:
    """Horovod's broadcast_object: the root's object on every rank."""
    binding = bind(process_set)
    root = _set_root(binding, int(root_rank))
    if binding is None or binding.size == 1:
        return obj
    rec = record(BROADCAST, [], root=int(root_rank), name=name)
    return matching.start(binding, rec, "broadcast_object",
                          lambda _: Handle.done(broadcast_object_on(binding, obj, root))).wait()


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet | None = None) -> list[Any]:
    """Horovod's allgather_object: a list of every rank's object, in rank order."""
    payload = _dumps(obj)
    handle = allgather_async([payload], name=name, process_set=process_set)
    gathered = handle.wait()[0]
    sizes = getattr(handle, "dim0s", [[payload.numel()]])[0]
    out, offset = [], 0
    for n in sizes:
        out.append(pickle.loads(gathered[offset:offset + n].numpy().tobytes()))
        offset += n
    return out


def barrier(process_set: ProcessSet | None = None) -> None:
    binding = bind(process_set)
    if binding is None or binding.size == 1:
        return
    matching.start(binding, record(BARRIER), "barrier", lambda _: Handle.done(None)).wait()



__all__ = ["CollectiveMismatchError"]
