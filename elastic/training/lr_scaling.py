"""Learning-rate scaling rules for a world size that changes while training runs.

When every worker keeps its per-worker batch, the global batch grows and shrinks
with the world, and the usual remedy is to scale the learning rate with it:

* ``"linear"``: ``lr * size / base_size`` (Goyal et al., for SGD-like optimizers)
* ``"sqrt"``:   ``lr * sqrt(size / base_size)`` (often preferred for Adam-like optimizers)

:class:`LRScaler` applies the factor only *while the wrapped optimizer steps*.
``group["lr"]`` always holds the unscaled value, which is the value that
``torch.optim.lr_scheduler`` schedulers read and write. So:

* effective lr = (what the scheduler set) x f(size) / f(base_size), exactly,
  for every scheduler (closed-form ones such as LambdaLR and recursive ones
  such as CosineAnnealingLR alike), because no scheduler ever sees a scaled value;
* nothing drifts: the factor is recomputed from the current size, never
  multiplied into stored state, so 4 -> 2 -> 3 -> 4 gives back exactly the lr of 4;
* checkpoints and state sync carry the unscaled lr, so they mean the same
  thing whatever the world size of the rank that sends them.

Typical use, one line next to the optimizer::

    scaler = elastic.LRScaler(optimizer, base_size=4, rule="linear")
    state.register_reset_callbacks([scaler])

Registering it as a reset callback refreshes :attr:`factor` (handy for logging)
at each membership change; the factor is also refreshed at every step, so the
scaled lr is right even without the callback.

``rule="adascale"`` measures the factor instead (:mod:`elastic.training.adascale`):
the gain r from the gradients' variance, at S = world size x accumulation steps.
Every rule counts :attr:`progress` in scale-invariant iterations (the factor of each
step, summed); ``drive(scheduler)`` steps a schedule written for one worker on it.
Give the scaler to the state (``TorchState(..., scaler=scaler)``) so that its
estimates and progress are committed, restored, synced and checkpointed.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

from elastic.training.adascale import GainEstimator, GradientNorms
from elastic.worker import runtime

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.optim.lr_scheduler import LRScheduler

# drive() hands back the scheduler it was given, as its own type.
Scheduler = TypeVar("Scheduler", bound="LRScheduler")

ADASCALE = "adascale"

RULES = {
    "linear": lambda size: float(size),
    "sqrt": lambda size: math.sqrt(size),
    "none": lambda size: 1.0,
}


def _observed(optimizer: torch.optim.Optimizer) -> Any:
    """A DistributedOptimizer, whose ``gradient_observer`` (not a torch attribute) we set."""
    return cast(Any, optimizer)


def _inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that actually steps: DistributedOptimizer delegates to it."""
    inner = optimizer.__dict__.get("_opt")
    return inner if inner is not None else optimizer


def scale_factor(size: int, base_size: int, rule: str | Callable = "linear") -> float:
    """``f(size) / f(base_size)`` for a rule name in :data:`RULES` or a callable ``f``."""
    if rule == ADASCALE:
        raise ValueError("the adascale factor comes from the gradients, not the size: "
                         "use LRScaler(..., rule='adascale')")
    f = RULES.get(rule) if isinstance(rule, str) else rule
    if f is None or not callable(f):
        raise ValueError(f"unknown lr scaling rule {rule!r}; use one of "
                         f"{sorted(RULES) + [ADASCALE]} or a callable size -> multiplier")
    if int(size) < 1 or int(base_size) < 1:
        raise ValueError(f"sizes must be >= 1, got size={size} base_size={base_size}")
    return float(f(int(size))) / float(f(int(base_size)))


class LRScaler:
    """Scales every param group's lr by the rule's factor during ``step()``.

    ``optimizer``: a torch optimizer or an ``elastic.DistributedOptimizer``.
    ``base_size``: the world size for which the configured lrs are right (for
    ``"adascale"``: the number of worker batches, world size x accumulation steps).
    ``rule``: ``"linear"``, ``"sqrt"``, ``"none"``, ``"adascale"`` or a callable
    ``size -> multiplier``, giving ``f(size) / f(base_size)``.
    ``size_fn``: where the current world size comes from (default ``elastic.size``).
    ``accumulation``: backward passes per step, for ``"adascale"`` (default: the
    DistributedOptimizer's ``backward_passes_per_step``, else 1).
    ``measure_every``: ``"adascale"`` measures the gradient norms every n-th step (the
    paper: every step); the averages keep their horizon in steps, the cost drops n-fold.

    The instance is callable with no arguments, so it can be passed to
    ``state.register_reset_callbacks``. ``group["lr"]`` keeps the unscaled value;
    :meth:`scaled_lrs` gives the lrs the optimizer actually uses.
    """

    # optimizer -> its scaler: one per optimizer, without writing onto the user's object
    _attached: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, optimizer: torch.optim.Optimizer, base_size: int,
                 rule: str | Callable = "linear", size_fn: Callable[[], int] | None = None,
                 accumulation: int | None = None, measure_every: int = 1) -> None:
        self.base_size = int(base_size)
        self.rule = rule
        self._size_fn = size_fn or runtime.size
        self._wrapper = optimizer
        self._opt = _inner_optimizer(optimizer)
        if self._opt in LRScaler._attached:
            raise RuntimeError("this optimizer already has an LRScaler; remove() it first")
        self._accumulation = accumulation
        if isinstance(measure_every, bool) or not isinstance(measure_every, int) or \
                measure_every < 1:
            raise ValueError(f"measure_every must be an int >= 1, not {measure_every!r}")
        self.measure_every = measure_every
        self.estimator = GainEstimator(base_size) if rule == ADASCALE else None
        self.progress = 0.0     # scale-invariant iterations: the sum of each step's factor
        self.steps = 0
        self._driven: list = []  # [(scheduler, every)] stepped on progress
        self.size: int = 0      # update() reads it next
        self.factor = 1.0
        self.update()   # validates rule and sizes before any hook is installed
        # [(group, unscaled, scaled)] while a step is running
        self._swapped: list[tuple[dict[str, Any], Any, Any]] | None = None
        self._handles = [self._opt.register_step_pre_hook(self._before_step),
                         self._opt.register_step_post_hook(self._after_step)]
        self._norms = None
        if self.estimator is not None:
            self._norms = GradientNorms(self.observe,
                                        lambda: self.steps % self.measure_every == 0)
            if optimizer is not self._opt:          # a DistributedOptimizer
                _observed(optimizer).gradient_observer = self._norms
        LRScaler._attached[self._opt] = self

    @property
    def gain(self) -> float:
        """The factor of the current scale: adascale's r, or the fixed rule's multiplier."""
        return self.factor

    def passes(self) -> int:
        """Backward passes per step (accumulation), as adascale counts the scale."""
        if self._accumulation is not None:
            return int(self._accumulation)
        return int(getattr(self._wrapper, "backward_passes_per_step", 1) or 1)

    def update(self) -> float:
        """Read the current world size and recompute :attr:`factor`. Returns the factor."""
        self.size = int(self._size_fn())
        if self.estimator is None:
            self.factor = scale_factor(self.size, self.base_size, self.rule)
        else:
            if self.size < 1 or self.passes() < 1:
                raise ValueError(f"sizes must be >= 1, got size={self.size} "
                                 f"accumulation={self.passes()}")
            self.factor = self.estimator.gain(self.size, self.passes())
        return self.factor

    __call__ = update   # a reset callback
    reset = update      # what TorchState calls on a membership change

    def observe(self, local_sq_sum: float, reduced_sq: float, workers: int | None = None) -> bool:
        """Feed adascale one step's gradient norms: the sum over workers of each one's
        squared local norm, and the squared norm of their mean. A DistributedOptimizer
        does this by itself; call it when gradients are reduced some other way."""
        if self.estimator is None:
            raise ValueError(f"observe() is for rule='adascale', not {self.rule!r}")
        workers = int(self._size_fn()) if workers is None else int(workers)
        return self.estimator.observe(local_sq_sum, reduced_sq, workers, self.passes(),
                                      self.measure_every)

    @property
    def ddp_comm_hook(self) -> Callable[[dist.ProcessGroup | None, dist.GradBucket],
                                        torch.futures.Future[torch.Tensor]]:
        """For DDP, which reduces the gradients itself: a comm hook that averages as DDP
        does and measures the norms on the way; ``model.register_comm_hook(None,
        scaler.ddp_comm_hook)``. With ``no_sync()`` accumulation, give ``accumulation=``."""
        if self._norms is None:
            raise ValueError(f"ddp_comm_hook is for rule='adascale', not {self.rule!r}")
        return self._norms.comm_hook

    def drive(self, scheduler: Scheduler, every: float = 1.0) -> Scheduler:
        """Step ``scheduler`` (LambdaLR, CosineAnnealingLR, StepLR...) once per ``every``
        scale-invariant iterations instead of once per step, so a schedule written in
        single-worker iterations holds at any scale. Put the scheduler in the state too.
        Returns the scheduler."""
        if not hasattr(scheduler, "last_epoch") or not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"drive() needs an lr scheduler with last_epoch, not {scheduler!r}")
        if not every > 0:
            raise ValueError(f"every must be > 0, not {every!r}")
        self._driven.append((scheduler, float(every)))
        return scheduler

    def scaled_lrs(self) -> list[float]:
        """The lr of each param group as the optimizer uses it at the current size."""
        factor = self.update() if self.estimator is not None else scale_factor(
            int(self._size_fn()), self.base_size, self.rule)
        return [group["lr"] * factor for group in self._opt.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """Progress and adascale's estimates: what a commit or a checkpoint keeps."""
        state: dict[str, Any] = {"rule": self.rule if isinstance(self.rule, str) else "callable",
                 "progress": self.progress, "steps": self.steps}
        if self.estimator is not None:
            state["estimator"] = self.estimator.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.progress = float(state["progress"])
        self.steps = int(state["steps"])
        if self.estimator is not None and "estimator" in state:
            self.estimator.load_state_dict(state["estimator"])
        self.update()

    def remove(self) -> None:
        """Detach from the optimizer; its lrs are then used unscaled again."""
        self._restore()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._wrapper is not self._opt and "gradient_observer" in vars(self._wrapper):
            _observed(self._wrapper).gradient_observer = None
        if LRScaler._attached.get(self._opt) is self:
            del LRScaler._attached[self._opt]

    # -- hooks ---------------------------------------------------------------------------
    def _restore(self) -> None:
        """Put the unscaled lrs back, unless something (load_state_dict, a scheduler)
        replaced the value we wrote: then that newer value is the unscaled one."""
        swapped, self._swapped = self._swapped, None
        for group, unscaled, scaled in swapped or ():
            if group["lr"] is scaled:
                group["lr"] = unscaled

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> None:
        self._restore()   # a step that raised never ran _after_step
        if self._norms is not None and self._norms.hooked:
            self._norms.step_done()      # DDP reduced this step's gradients in backward
        factor = self.update()
        swapped: list[tuple[dict[str, Any], Any, Any]] = []
        for group in self._opt.param_groups:
            unscaled = group["lr"]
            scaled = unscaled * factor
            group["lr"] = scaled
            swapped.append((group, unscaled, scaled))
        self._swapped = swapped

    def _after_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> None:
        self._restore()
        self.progress += self.factor
        self.steps += 1
        for scheduler, every in self._driven:
            while scheduler.last_epoch < int(self.progress // every):
                scheduler.step()
