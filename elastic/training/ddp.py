"""``elastic.DistributedDataParallel``: torch's DDP whose process group follows the rounds.

torch's ``DistributedDataParallel`` binds one process group for life, and the
rounds of an elastic job each have their own (the round's default group,
torch_world.py). This wrapper builds torch's DDP on the first forward pass
of each round, on that round's group, on every rank alike (a newcomer's reducer
and its peers' must take the same steps: bucket rebuilds are collectives), and
without DDP's own start-up broadcast: ``TorchState``'s sync already made the
ranks equal. A backward pass cut short by a departed peer leaves nothing
behind: its reducer goes with its round. Gradient bucketing and overlap,
``no_sync()`` and comm hooks are torch's own.

Every comm hook's future is made abortable (abortable.py): DDP waits on it in
C++, so a backward pass whose peer died raises (and ``@elastic.run`` restores
the last commit) instead of blocking until the group's timeout. Without a hook
of yours, the hook is an average like DDP's own.

Outside elasticrun the wrapper is the plain module (size 1), or torch's DDP on
the default group when the script initialised torch.distributed itself.
``state_dict()`` keys carry the ``module.`` prefix, as torch's DDP's do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from elastic.worker import runtime, torch_world
from elastic.worker.abortable import abortable
from elastic.worker.collectives import ReduceOp

if TYPE_CHECKING:
    from typing_extensions import Self

    # A DDP comm hook: (its state, a bucket of gradients) -> the reduced bucket's future.
    CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def _average_hook(wrapper, bucket):
    """DDP's default reduction, as a Python hook whose future an abort can fail."""
    group = wrapper.process_group
    buffer = bucket.buffer().div_(group.size())
    return group.allreduce([buffer]).get_future()


class DistributedDataParallel(torch.nn.Module):
    """``DistributedDataParallel(module, **ddp_kwargs)``: torch's DDP, elastic.

    ``op`` is ``Average``, so ``ElasticSampler.global_batches(model, ...)``
    weights micro-batches for it (constant-global-batch training with DDP).
    """

    op = ReduceOp.Average

    def __init__(self, module: torch.nn.Module, **ddp_kwargs: Any) -> None:
        super().__init__()
        self.module = module
        # No collectives at construction: a newcomer builds its DDP while the others
        # move theirs (no collective either), and TorchState's sync equalised the state.
        self._ddp_kwargs = dict(ddp_kwargs, init_sync=False)
        self._hook: tuple[Any, CommHook] | None = None   # (state, hook) given by register_comm_hook
        self.__dict__["_ddp"] = None     # not a submodule: state_dict keys stay module.*
        self.__dict__["process_group"] = None
        self.rebinds = 0           # rounds whose DDP replaced an earlier one's (tests; logs)
        self._sync_backward = True

    # -- the round's DDP --------------------------------------------------------------
    def _group(self):
        group = torch_world.current()
        if group is None and runtime.ensure_joined() is not None:   # inits; joins between rounds
            group = torch_world.current()
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD           # torchrun, or a script's own init
        return group

    @property
    def ddp(self) -> TorchDDP | None:
        """torch's DDP, bound to the current round's group (None at size 1 alone)."""
        group = self._group()
        ddp: TorchDDP | None = self._ddp   # type: ignore[assignment]  # (in __dict__, not a submodule)
        if group is None:
            return None
        if ddp is not None and self.process_group is group:
            return ddp
        if ddp is not None:
            ddp._remove_autograd_hooks()       # the old reducer lets go of the parameters
            self.rebinds += 1
        ddp = TorchDDP(self.module, process_group=group, **self._ddp_kwargs)
        ddp.train(self.training)
        self.__dict__["_ddp"] = ddp
        self.__dict__["process_group"] = group
        self._register_hook(ddp, group)
        return ddp

    def _register_hook(self, ddp, group):
        elastic_group = isinstance(group, torch_world.RoundGroup)
        if self._hook is None:
            if elastic_group:
                ddp.register_comm_hook(self, self._abortable(_average_hook))
            return
        state, hook = self._hook
        ddp.register_comm_hook(state, self._abortable(hook) if elastic_group else hook)

    def _abortable(self, hook):
        def run(state, bucket):
            group = self.process_group
            return abortable(hook(state, bucket), group).then(_one_tensor)
        run.__name__ = getattr(hook, "__name__", "hook")     # DDP logs the hook's name
        return run

    # -- torch's DDP interface ---------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ddp = self.ddp
        if ddp is None:
            return self.module(*args, **kwargs)
        if self._sync_backward:
            return ddp(*args, **kwargs)
        with ddp.no_sync():
            return ddp(*args, **kwargs)

    def sync_backward(self, sync: bool) -> None:
        """Whether the next forward's backward reduces gradients (False: it accumulates,
        as under ``no_sync()``). torch's DDP decides at the forward pass, so a
        micro-batch's ``backward`` would be too late: ``global_batches`` calls this
        before each micro-batch."""
        self._sync_backward = sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (torch's ``no_sync``)."""
        ddp = self.ddp
        with ddp.no_sync() if ddp is not None else contextlib.nullcontext():
            yield

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """torch's ``register_comm_hook``, kept across rounds; before the first forward.
        A ``state`` of None means the current round's group (as torch's hooks read it)."""
        if self._ddp is not None or self._hook is not None:
            raise RuntimeError("register_comm_hook: call it once, before the first forward")
        self._hook = (state, hook)

    def train(self, mode: bool = True) -> Self:
        super().train(mode)
        if self._ddp is not None:
            self._ddp.train(mode)   # type: ignore[union-attr]
        return self


def _one_tensor(fut):
    value = fut.value()
    return value[0] if isinstance(value, (list, tuple)) else value


DDP = DistributedDataParallel
