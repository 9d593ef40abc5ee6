"""Checks of DistributedOptimizer's arguments, with Horovod's error wording where it has one."""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch

from elastic.exceptions import ElasticError

STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() after "
    "optimizer.synchronize(): wrap step() in `with optimizer.skip_synchronize():` when you "
    "synchronize yourself (the gradients are not reduced twice either way)")


class ReducingSet(Protocol):
    """What DistributedOptimizer uses of a process set (elastic.torch's ProcessSet):
    whether this rank is in it, and its bucket allreduce (a handle for
    ``collectives.synchronize``, or None)."""

    process_set_id: int | None

    def included(self) -> bool: ...

    def reduce_async(self, tensor: torch.Tensor, op: str) -> tuple | None: ...


class TooManyBackwardPassesError(ElasticError, AssertionError):
    """A gradient was computed more often than backward_passes_per_step before step():
    an AssertionError, as Horovod raises it from backward(), and a RuntimeError."""


def check_passes(passes: object) -> int:
    if not (isinstance(passes, int) and not isinstance(passes, bool) and passes >= 1):
        raise ValueError(f"backward_passes_per_step must be an int >= 1, not {passes!r}")
    return passes


def check_process_set(process_set: Any) -> ReducingSet | None:
    """None, the global set, or a registered elastic.torch ProcessSet (reduced over its
    members by its ``reduce_async``)."""
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        return process_set
    if not (callable(getattr(process_set, "reduce_async", None))
            and callable(getattr(process_set, "included", None))):
        raise ValueError(f"process_set must be an elastic.torch ProcessSet, not {process_set!r}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not registered: call add_process_set() first")
    return process_set


def check_groups(groups: object,
                 optimizer: torch.optim.Optimizer) -> int | list[list[torch.Tensor]] | None:
    """Horovod's ``groups``: None, an int > 0, or lists of the optimizer's parameters."""
    if groups is None:
        return None
    if isinstance(groups, bool):
        raise ValueError("groups should be a non-negative integer or a list of lists of "
                         "torch.Tensor")
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError("groups should be a non-negative integer or a list of lists of "
                             "torch.Tensor")
        return groups or None
    if not isinstance(groups, (list, tuple)):
        raise ValueError("groups should be a non-negative integer or a list of lists of "
                         "torch.Tensor")
    known = {p for g in optimizer.param_groups for p in g["params"]}
    seen: set[torch.Tensor] = set()
    out: list[list[torch.Tensor]] = []
    for group in groups:
        members = list(group)
        for p in members:
            if not isinstance(p, torch.Tensor):
                raise ValueError("groups must consist of torch.Tensor")
            if p in seen:
                raise ValueError("a parameter can only appear once in groups")
            if p not in known:
                raise ValueError("groups holds a tensor that the optimizer does not train")
            seen.add(p)
        out.append(members)
    return out


def check_names(optimizer: torch.optim.Optimizer,
                named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> dict[torch.Tensor, str]:
    """Names only label errors, but a wrong list usually means the wrong model was passed."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if not all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
               for item in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, "
                         "as model.named_parameters() gives")
    duplicates = sorted(n for n, c in collections.Counter(n for n, _ in named).items() if c > 1)
    if duplicates:
        raise ValueError(f"named_parameters has duplicate names: {duplicates}")
    names = {p: n for n, p in named}
    missing = sum(1 for p in params if p not in names)
    if missing:
        raise ValueError(f"{missing} parameter(s) of the optimizer are not in named_parameters; "
                         "pass the named_parameters() of the model the optimizer trains")
    return names


FUSION_ENV = "HOROVOD_FUSION_THRESHOLD"   # bytes, as horovodrun's --fusion-threshold-mb sets it


def default_bucket_cap_mb(environ: Mapping[str, str] = os.environ) -> float:
    """$HOROVOD_FUSION_THRESHOLD in MiB (0: one tensor per bucket, as in Horovod), else 25."""
    raw = environ.get(FUSION_ENV, "")
    if raw == "":
        return 25
    try:
        nbytes = float(raw)
    except ValueError:
        raise ValueError(f"{FUSION_ENV}={raw!r} is not a number of bytes") from None
    if not nbytes >= 0:
        raise ValueError(f"{FUSION_ENV}={raw!r} must be 0 or more")
    return max(nbytes, 1.0) / 2 ** 20
