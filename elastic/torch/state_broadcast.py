"""Horovod's ``broadcast_optimizer_state``, with its handling of new optimizers.

The root's ``state_dict`` is shipped whole (collectives.broadcast_optimizer_state),
so parameters without state on the root simply have none anywhere. Horovod
first gives every trainable parameter that has no gradient a zero gradient
when the optimizer has no state yet, and leaves it there; scripts read those
gradients afterwards (``hvd.broadcast(p.grad, 0)``), so we do the same.
Parameters with ``requires_grad=False`` keep ``grad`` None. Unlike Horovod we
take no dummy ``step()`` (with weight decay it would move the weights).
"""

from __future__ import annotations

import torch

from elastic.worker import collectives


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank the root's optimizer state (hyper-parameters included)."""
    if not optimizer.state:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
                    if isinstance(optimizer, torch.optim.SparseAdam):
                        p.grad = p.grad.to_sparse()
    collectives.broadcast_optimizer_state(optimizer, root_rank)
