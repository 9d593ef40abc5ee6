"""AdaScale: a learning-rate gain measured from the gradients themselves.

AdaScale SGD (Johnson, Agrawal, Gu and Guestrin, ICML 2020) asks how much one
step at scale S (the gradient averaged over S batches) is worth in steps at
scale 1. With mu^2 the squared norm of the true gradient and sigma^2 the
variance (trace of the covariance) of one batch's gradient, the answer is the
gain ratio

    r = (sigma^2 + mu^2) / (sigma^2 / S + mu^2),     1 <= r <= S.

The step uses lr x r, and training counts r "scale-invariant iterations" per
step, so a schedule written for scale 1 runs on that count at any scale.

Neither quantity is known; both come from the gradients of one step. Each of the
W workers holds a local gradient L_i, the mean of k backward passes (its
accumulation steps), and the allreduce gives their mean g. For independent
batches E|L_i|^2 = mu^2 + sigma^2/k and E|g|^2 = mu^2 + sigma^2/(W k), so

    sigma^2 ~ (mean_i |L_i|^2 - |g|^2) / (1/k - 1/(W k)),   mu^2 ~ |g|^2 - sigma^2/(W k)

are unbiased (sigma^2 here is one backward pass's). Both are smoothed with
exponential moving averages of weight theta = max(1 - S/1000, 0), as in the
paper, with the usual bias correction. sigma^2 and mu^2 describe the problem,
not the scale: when workers join or leave, the averages carry over unchanged and
only S in the gain formula changes, so the gain follows the world without a jump
in the estimates and without a restart of the averaging. With one worker there
is nothing to compare: the averages are kept as they are until peers return.

``base_size`` (B) says how many worker batches the configured lrs were tuned for:
the reference scale is B backward passes, so S = W k / B and r = 1 at W k = B.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic.worker import collectives, runtime

__all__ = ["GainEstimator", "GradientNorms", "smoothing"]


def smoothing(scale: float) -> float:
    """The moving averages' weight for the past at scale S: max(1 - S/1000, 0)."""
    return max(1.0 - float(scale) / 1000.0, 0.0)


class GainEstimator:
    """Moving averages of sigma^2 (per backward pass) and mu^2, and the gain they give.

    Pure arithmetic on scalars: the same on every rank given the same reduced inputs.
    """

    def __init__(self, base_size: int = 1) -> None:
        if int(base_size) < 1:
            raise ValueError(f"base_size must be >= 1, got {base_size}")
        self.base_size = int(base_size)
        self.var_avg = 0.0      # EMA of sigma^2 estimates, not yet bias-corrected
        self.sqr_avg = 0.0      # EMA of mu^2 estimates
        self.weight = 0.0       # EMA of ones: divides the two above (bias correction)
        self.observations = 0

    def observe(self, local_sq_sum: float, reduced_sq: float, workers: int,
                passes: int = 1, interval: int = 1) -> bool:
        """Fold in one step: the sum over the W workers of |L_i|^2, and |g|^2 for g their
        mean. Returns False (and changes nothing) when the step says nothing: one
        worker, or a norm that is not finite (an overflowed fp16 step, say).
        ``interval``: steps since the last observation; the weight of the past is
        theta^interval, so measuring every n-th step keeps the averages' horizon in steps."""
        workers, passes = int(workers), int(passes)
        if workers < 2 or passes < 1:
            return False
        local_sq_sum, reduced_sq = float(local_sq_sum), float(reduced_sq)
        if not (math.isfinite(local_sq_sum) and math.isfinite(reduced_sq)):
            return False
        samples = workers * passes
        var = (local_sq_sum / workers - reduced_sq) / (1.0 / passes - 1.0 / samples)
        sqr = reduced_sq - var / samples
        theta = smoothing(samples / self.base_size) ** max(int(interval), 1)
        self.var_avg = theta * self.var_avg + (1.0 - theta) * var
        self.sqr_avg = theta * self.sqr_avg + (1.0 - theta) * sqr
        self.weight = theta * self.weight + (1.0 - theta)
        self.observations += 1
        return True

    def estimates(self) -> tuple[float, float]:
        """(sigma^2 per backward pass, mu^2), bias-corrected and clipped at 0; (0, 0)
        before the first observation."""
        if self.weight <= 0.0:
            return 0.0, 0.0
        return max(self.var_avg / self.weight, 0.0), max(self.sqr_avg / self.weight, 0.0)

    def gain(self, workers: int, passes: int = 1) -> float:
        """r at W workers of k passes, against the reference of ``base_size`` passes."""
        var, sqr = self.estimates()
        reference = var / self.base_size + sqr
        current = var / (int(workers) * int(passes)) + sqr
        if reference <= 0.0 or current <= 0.0:
            return 1.0      # nothing measured yet (or a zero gradient): no opinion
        return reference / current

    def state_dict(self) -> dict[str, float]:
        return {"var_avg": self.var_avg, "sqr_avg": self.sqr_avg, "weight": self.weight,
                "observations": self.observations}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.var_avg = float(state["var_avg"])
        self.sqr_avg = float(state["sqr_avg"])
        self.weight = float(state["weight"])
        self.observations = int(state["observations"])


class GradientNorms:
    """Measures a step's gradient norms as the reduction goes: |local|^2 of each bucket
    as it leaves, one scalar allreduce (Sum) of their total queued behind the last
    bucket on the same group, |reduced|^2 of each bucket once back. Fed by a
    DistributedOptimizer (its ``gradient_observer``) or, as a comm hook, by DDP.

    Nobody waits for the scalar: a step's norms are folded in at the next step, when its
    allreduce has long finished, so the gain of step t uses the steps before it (one
    step of lag in averages that span hundreds). A step whose reduction was abandoned
    (a failure, zero_grad mid-flight) leaves nothing behind, and neither does the last
    step of a round: its sum belongs to the old group. Both happen on every rank alike.
    """

    def __init__(self, on_step: Callable[[float, float, int], object],
                 measuring: Callable[[], bool] = lambda: True) -> None:
        self._on_step = on_step    # called with (local_sq_sum, reduced_sq, workers)
        self._measuring = measuring   # asked at each step's first bucket; same on every rank
        self._on = False
        self._local: torch.Tensor | None = None
        self._reduced: float | torch.Tensor = 0.0
        # (sum tensor, its wait, workers) of this step's scalar
        self._launched: tuple[torch.Tensor, Callable[[], object], int] | None = None
        # (round, sum tensor, its wait, reduced_sq, workers)
        self._pending: tuple[int, torch.Tensor, Callable[[], object], float | torch.Tensor,
                             int] | None = None
        self.hooked = False        # fed by DDP: the step itself says when a step ends

    def local(self, flat: torch.Tensor, index: int, last: bool,
              group: dist.ProcessGroup | None = None) -> None:
        """Bucket ``index`` is about to be reduced (``last``: the step's last); ``flat``
        holds this rank's values. ``group``: a torch.distributed group for the scalar
        (DDP's); by default elastic's collectives (DistributedOptimizer's)."""
        if index == 0:
            self._on, self._local, self._launched = bool(self._measuring()), None, None
            self._reduced = 0.0
        if not self._on:
            return
        sq = _squared_norm(flat)
        self._local = sq if self._local is None else self._local + sq
        if last:
            total = self._local.reshape(1).to(torch.float64)
            if group is None:
                handle = collectives.allreduce_async(total, collectives.Sum)
                wait, workers = (lambda: collectives.synchronize(handle)), runtime.size()
            else:
                wait = dist.all_reduce(total, group=group, async_op=True).wait
                workers = dist.get_world_size(group)
            self._launched = (total, wait, workers)
            self._local = None

    def add_reduced(self, flat: torch.Tensor) -> None:
        """A bucket's reduced values (the mean over workers)."""
        if self._on:
            self._reduced = self._reduced + _squared_norm(flat)   # a tensor: no device sync

    def reduced(self, flats: list[torch.Tensor], op: str) -> None:
        """Every bucket is reduced; ``flats`` hold the results under ``op``."""
        for flat in flats:
            self.add_reduced(flat)
        self.step_done(op)

    def step_done(self, op: str = collectives.Average) -> None:
        """The step's reduction is complete: fold in the previous step, keep this one."""
        w = runtime.worker()
        round_id = w.round_id if w is not None else 0
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == round_id:
            _, total, wait, reduced_sq, workers = pending
            wait()
            self._on_step(float(total), float(reduced_sq), workers)   # ready long since
        launched, self._launched = self._launched, None
        reduced_sq, self._reduced = self._reduced, 0.0
        if launched is None or op not in (collectives.Average, collectives.Sum):
            return                  # not measured, or Min/Max/Product: no mean gradient
        total, wait, workers = launched
        if op == collectives.Sum:   # the sum of W means: |g|^2 of the mean is 1/W^2 of it
            reduced_sq /= workers * workers
        self._pending = (round_id, total, wait, reduced_sq, workers)

    def comm_hook(self, state: dist.ProcessGroup | None,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """A DDP comm hook: DDP's average (over ``state``, a process group, or the
        default group when None), measuring the norms on the way."""
        self.hooked = True
        group = state if state is not None else dist.group.WORLD
        buffer = bucket.buffer()
        self.local(buffer, bucket.index(), bucket.is_last(), group)
        buffer.div_(dist.get_world_size(group))
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future()

        def reduced(fut: torch.futures.Future[Any]) -> torch.Tensor:
            value = fut.value()
            out = value[0] if isinstance(value, (list, tuple)) else value
            self.add_reduced(out)
            return out
        return future.then(reduced)


def _squared_norm(flat: torch.Tensor) -> torch.Tensor:
    if flat.dtype in (torch.float32, torch.float64):
        return torch.linalg.vector_norm(flat).square()
    return torch.linalg.vector_norm(flat, dtype=torch.float32).square()
