"""Adasum, the adaptive summation of Maleki et al. (MLSys 2021).

Two gradients a and b combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is a + b for orthogonal gradients and their average for equal ones.
Across n ranks the pairs combine in a binary tree by distance doubling: at
level k, rank r meets rank r xor 2^k, both compute the same combination (the
lower rank's vector first, dot products in float64), so after log2(n) levels
every rank holds the same result. As with Horovod's CPU implementation, n
must be a power of two. Each tensor of a group is combined on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from elastic.torch import negotiation
from elastic.torch.errors import AdasumUnsupportedError
from elastic.worker import collectives

if TYPE_CHECKING:
    from elastic.torch.process_sets import Binding

OP_CODE = 6


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check(tensors: Sequence[torch.Tensor], binding: Binding | None) -> None:
    """Raise AdasumUnsupportedError (the same on every rank) when Adasum cannot run here."""
    size = 1 if binding is None else binding.size
    if not is_power_of_two(size):
        raise AdasumUnsupportedError(f"Adasum needs a power-of-two number of ranks, got {size}")
    for t in tensors:
        if not t.dtype.is_floating_point:
            raise AdasumUnsupportedError(f"Adasum reduces floating-point tensors, not {t.dtype}")


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """adasum(a, b) in float64; ``a`` is the lower rank's tensor."""
    a64, b64 = a.double(), b.double()
    dot = float((a64 * b64).sum())
    aa, bb = float((a64 * a64).sum()), float((b64 * b64).sum())
    ca = 1.0 - dot / (2 * aa) if aa > 0 else 1.0
    cb = 1.0 - dot / (2 * bb) if bb > 0 else 1.0
    return a64 * ca + b64 * cb


def allreduce_(tensors: list[torch.Tensor], binding: Binding) -> list[torch.Tensor]:
    """Replace each tensor by the Adasum of its values on every rank of ``binding``."""
    me, level = binding.rank, 1
    group = binding.cpu_group if not tensors or not tensors[0].is_cuda else binding.device_group
    while level < binding.size:
        partner = me ^ level
        for t in tensors:
            mine = t.detach().contiguous()
            theirs = torch.empty_like(mine)
            send = negotiation.issue(partial(group.send, [mine], partner, level), "adasum")
            recv = negotiation.issue(partial(group.recv, [theirs], partner, level), "adasum")
            collectives.wait(send, "adasum", binding.worker)
            collectives.wait(recv, "adasum", binding.worker)
            lower, upper = (mine, theirs) if me < partner else (theirs, mine)
            t.copy_(combine(lower, upper).to(t.dtype))
        level *= 2
    return tensors
