"""Reductions with Horovod's semantics: allreduce (grouped, in place) and reducescatter.

Dtypes are preserved. Scale factors follow Horovod: integers are scaled in
float64 and truncated back, half precision on CPU in float32, the rest in
their own dtype; Average is the sum scaled by 1/size after any postscale.
gloo cannot reduce int16, so int16 travels as int32 and comes back as int16.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from elastic.torch import adasum, matching, move_ops, negotiation
from elastic.torch.errors import UnsupportedOpError
from elastic.torch.handles import Handle, claim_name
from elastic.torch.negotiation import ALLREDUCE, JOIN, REDUCESCATTER, record
from elastic.torch.process_sets import bind
from elastic.worker.collectives import Average, Max, Min, Product, Sum

if TYPE_CHECKING:
    from elastic.torch.negotiation import Outcome
    from elastic.torch.process_sets import Binding, ProcessSet

Adasum = "adasum"
OP_CODES = {Average: 1, Sum: 2, Min: 3, Max: 4, Product: 5, Adasum: adasum.OP_CODE}
_TORCH_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
              Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
_WIRE = {torch.int16: torch.int32}


def resolve_op(average: bool | None, op: str | None) -> str:
    """Horovod's ``average=`` (deprecated) and ``op=`` arguments, to one op."""
    if op is not None and average is not None:
        raise ValueError("give op= or the deprecated average=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op not in OP_CODES:
        raise ValueError(f"unknown reduction op {op!r}; use Average, Sum, Min, Max, Product "
                         "or Adasum")
    return op


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply in place by ``factor`` without changing the dtype (Horovod's rules)."""
    if factor == 1.0:
        return tensor
    if tensor.dtype.is_floating_point and tensor.dtype in (torch.float16, torch.bfloat16) \
            and not tensor.is_cuda:
        return tensor.copy_(tensor.float() * factor)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return tensor.mul_(factor)
    if tensor.dtype == torch.bool:
        raise ValueError("cannot scale a bool tensor")
    return tensor.copy_((tensor.double() * factor).to(tensor.dtype))   # truncates, as Horovod


def _identity_like(tensor, op):
    """What a joined rank contributes: a value that leaves the others' result unchanged."""
    if op in (Average, Sum):
        return torch.zeros_like(tensor)
    if op == Product:
        return torch.ones_like(tensor)
    info = torch.finfo(tensor.dtype) if tensor.dtype.is_floating_point else \
        torch.iinfo(tensor.dtype)
    return torch.full_like(tensor, info.max if op == Min else info.min)


def allreduce_async_(tensors: list[torch.Tensor], op: str, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, name: str | None = None,
                     process_set: ProcessSet | None = None, kind: str = "allreduce",
                     deferrable: bool = False) -> Handle:
    """Reduce ``tensors`` (a list) in place; the handle's result is the list.

    ``deferrable``: an async op, which may wait for peers that issue its name later.
    """
    binding = bind(process_set)
    if op == Adasum:
        adasum.check(tensors, binding)
    name_key = claim_name(kind, name)
    if binding is None or binding.size == 1:
        for t in tensors:
            scale_(t, prescale_factor * postscale_factor)
        return Handle(name_key=name_key, finish=lambda: tensors)

    def issue(outcome):
        if outcome.joined:
            _describe_for_joined(binding, outcome, tensors)
        for t in tensors:
            scale_(t, prescale_factor)
        if op == Adasum:
            adasum.allreduce_(tensors, binding)
            for t in tensors:
                scale_(t, postscale_factor)
            return Handle(name_key=name_key, finish=lambda: tensors)
        wires = [t.to(_WIRE[t.dtype]) if t.dtype in _WIRE else t for t in tensors]
        works = [_issue_allreduce(binding, wire, op) for wire in wires]
        post = postscale_factor / binding.size if op == Average else postscale_factor

        def finish():
            for t, wire in zip(tensors, wires):
                if wire is not t:
                    t.copy_(wire)
                _finish_scale(t, post, op, binding.size, postscale_factor)
            return tensors

        return Handle(works, finish, binding.worker, name_key, what=kind)

    rec = record(ALLREDUCE, tensors, op=OP_CODES[op], name=name)
    return matching.start(binding, rec, kind, issue, name_key, deferrable=deferrable)


def _finish_scale(tensor, post, op, size, postscale_factor):
    if op == Average and postscale_factor == 1.0 and (tensor.dtype.is_floating_point
                                                      or tensor.dtype.is_complex):
        if tensor.dtype in (torch.float16, torch.bfloat16) and not tensor.is_cuda:
            tensor.copy_(tensor.float() / size)
        else:
            tensor.div_(size)
    else:
        scale_(tensor, post)


def _issue_allreduce(binding, tensor, op):
    opts = dist.AllreduceOptions()
    opts.reduceOp = _TORCH_OPS[op]
    group = binding.group_for(tensor)
    return negotiation.issue(lambda: group.allreduce([tensor], opts), "allreduce")


def _describe_for_joined(binding, outcome, tensors):
    """The lowest active rank tells the joined ranks what to contribute."""
    desc = [(tuple(t.shape), str(t.dtype).replace("torch.", ""), t.device.type) for t in tensors]
    move_ops.broadcast_object_on(binding, desc, outcome.active[0])


def join_allreduce(binding: Binding, outcome: Outcome) -> None:
    """A joined rank's part in the others' allreduce: identity values of their shapes."""
    desc = move_ops.broadcast_object_on(binding, None, outcome.active[0])
    code = int(outcome.records[outcome.active[0]][negotiation.OP])
    op = next(k for k, v in OP_CODES.items() if v == code)
    works = []
    for shape, dtype, device in desc:
        device = "cuda" if device == "cuda" else "cpu"
        t = _identity_like(torch.empty(shape, dtype=getattr(torch, dtype), device=device), op)
        wire = t.to(_WIRE[t.dtype]) if t.dtype in _WIRE else t
        works.append(_issue_allreduce(binding, wire, op))
    for work in works:
        from elastic.worker import collectives
        collectives.wait(work, "join", binding.worker)


def split_sizes(dim0: int, size: int) -> list[int]:
    """Horovod's reducescatter split of the first dimension: lower ranks get the extra rows."""
    return [dim0 // size + (1 if r < dim0 % size else 0) for r in range(size)]


def reducescatter_async(tensors: Sequence[torch.Tensor], op: str, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, name: str | None = None,
                        process_set: ProcessSet | None = None, deferrable: bool = False) -> Handle:
    """Reduce, then keep this rank's share of the first dimension; result: list of tensors.

    It moves as many bytes as an allreduce (gloo has no uneven reduce-scatter).
    """
    if op not in (Average, Sum):
        raise UnsupportedOpError(f"reducescatter supports Average and Sum, not {op!r}")
    for t in tensors:
        if t.dim() == 0:
            raise UnsupportedOpError("reducescatter needs tensors with at least one dimension")
    work = [t.detach().clone() for t in tensors]
    binding = bind(process_set)
    if binding is None or binding.size == 1:
        return allreduce_async_(work, op, prescale_factor, postscale_factor, name, process_set,
                                kind="reducescatter")
    name_key = claim_name("reducescatter", name)

    def issue(outcome):
        for t in work:
            scale_(t, prescale_factor)
        wires = [t.to(_WIRE[t.dtype]) if t.dtype in _WIRE else t for t in work]
        works = [_issue_allreduce(binding, wire, op) for wire in wires]
        post = postscale_factor / binding.size if op == Average else postscale_factor

        def finish():
            out = []
            for t, wire in zip(work, wires):
                sizes = split_sizes(t.shape[0], binding.size)
                start = sum(sizes[:binding.rank])
                piece = wire[start:start + sizes[binding.rank]].to(t.dtype).clone()
                _finish_scale(piece, post, op, binding.size, postscale_factor)
                out.append(piece)
            return out

        return Handle(works, finish, binding.worker, name_key, what="reducescatter")

    rec = record(REDUCESCATTER, work, op=OP_CODES[op], name=name)
    return matching.start(binding, rec, "reducescatter", issue, name_key,
                          deferrable=deferrable)


def join(device: int = -1, process_set: ProcessSet | None = None) -> int:
    """Wait until every rank has joined, taking part in the others' allreduces meanwhile.

    A joined rank contributes identity values (0 for Sum and Average, so Average
    still divides by the full size, as in Horovod). Other ops raise on the ranks
    that issue them. Returns the rank that joined last.
    """
    binding = bind(process_set)
    if binding is None or binding.size == 1:
        return 0 if binding is None else binding.ranks[0]
    rec = record(JOIN, join_step=negotiation.exchanges_so_far(binding))
    while True:
        outcome = negotiation.negotiate(binding, rec, "join")
        if outcome.all_joined:
            steps = [(int(r[negotiation.JOIN_STEP]), i) for i, r in enumerate(outcome.records)]
            return binding.global_rank(max(steps)[1])
        if outcome.error is None and outcome.joinable:
            join_allreduce(binding, outcome)
        # Otherwise the active ranks raise their error and carry on; so do we.
