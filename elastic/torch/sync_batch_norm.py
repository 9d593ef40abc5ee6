"""SyncBatchNorm: batch statistics over the whole global batch, on CPU and GPU.

Each rank sends its per-channel count, mean and sum of squared deviations;
they merge exactly (Chan et al.'s pairwise update), so the result equals a
BatchNorm over the concatenated batch. Backward sums the two per-channel
reductions it needs across ranks; weight and bias gradients stay local, for
DistributedOptimizer to average like any other gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elastic.torch import move_ops, reduce_ops
from elastic.torch.process_sets import ProcessSet, global_process_set
from elastic.worker.collectives import Sum


def _merged_stats(x, channels_dim, process_set):
    dims = [d for d in range(x.dim()) if d != channels_dim]
    x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    count = x32.numel() // x32.shape[channels_dim]
    mean = x32.mean(dims)
    m2 = ((x32 - _expand(mean, x32)) ** 2).sum(dims)
    local = torch.cat([torch.tensor([float(count)], dtype=mean.dtype), mean.detach(),
                       m2.detach()]).unsqueeze(0)
    rows = move_ops.allgather_async([local], None, process_set).wait()[0]
    counts, means, m2s = rows[:, 0], rows[:, 1:1 + mean.numel()], rows[:, 1 + mean.numel():]
    total = counts.sum()
    g_mean = (counts.unsqueeze(1) * means).sum(0) / total
    g_m2 = (m2s + counts.unsqueeze(1) * (means - g_mean) ** 2).sum(0)
    return g_mean, g_m2 / total, int(total.item()), g_m2


def _expand(per_channel, x):
    return per_channel.reshape((1, -1) + (1,) * (x.dim() - 2))


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, eps, total, process_set):
        invstd = torch.rsqrt(var + eps)
        xhat = (x.to(mean.dtype) - _expand(mean, x)) * _expand(invstd, x)
        out = xhat
        if weight is not None:
            out = out * _expand(weight.to(mean.dtype), x) + _expand(bias.to(mean.dtype), x)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.total, ctx.process_set = total, process_set
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        xhat, invstd, weight = ctx.saved_tensors
        dims = [d for d in range(xhat.dim()) if d != 1]
        g = grad.to(xhat.dtype)
        sum_dy, sum_dy_xhat = g.sum(dims), (g * xhat).sum(dims)
        both = torch.cat([sum_dy, sum_dy_xhat])
        (both,) = reduce_ops.allreduce_async_([both], Sum, process_set=ctx.process_set).wait()
        n = sum_dy.numel()
        mean_dy, mean_dy_xhat = both[:n] / ctx.total, both[n:] / ctx.total
        scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
        dx = (g - _expand(mean_dy, g) - xhat * _expand(mean_dy_xhat, g)) * _expand(scale, g)
        dw = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        db = sum_dy.to(weight.dtype) if weight is not None else None
        return dx.to(grad.dtype), dw, db, None, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Horovod's SyncBatchNorm (any input of 2 or more dimensions, channels in dim 1)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet | None = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _track_batch(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """Count this batch: (running_mean, running_var, the momentum to update them
        with), or None when this forward leaves the running statistics alone."""
        if not (self.training and self.track_running_stats):
            return None
        tracked, running_mean, running_var = (self.num_batches_tracked, self.running_mean,
                                              self.running_var)
        assert tracked is not None and running_mean is not None and running_var is not None, \
            "track_running_stats=True registers them"
        tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else 1.0 / float(tracked)
        return running_mean, running_var, momentum

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        running = self._track_batch()
        mean, var, total, m2 = _merged_stats(input, 1, self.process_set)
        if running is not None:
            running_mean, running_var, momentum = running
            with torch.no_grad():
                unbiased = m2 / max(total - 1, 1)
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, mean.detach(),
                                      var.detach(), self.eps, total, self.process_set)
