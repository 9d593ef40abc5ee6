"""NCCL groups that are bounded and abortable.

Why this is not gloo's path (docs/architecture.md, "GPU path"):

* A group is created eagerly, bound to its device and with a finite timeout, so
  the communicator is set up while the round forms (where an abort can
  interrupt the wait) and not lazily inside the first backward hook.
* NCCL work completes its future when the kernel is enqueued, so a bounded wait
  polls ``work.is_completed()`` (``wait_polling``, through ``sliced.wait_sliced``)
  in slices that watch the round's abort key.
* A survivor's GPU stream stays blocked on a dead peer until the communicator
  is aborted, and the next CUDA synchronisation would hang, so an abandoned
  round's NCCL group is aborted (``abort``) before the worker moves on.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

import torch.distributed as dist

from elastic.exceptions import WorkersDepartedError
from elastic.worker.devices import PlacementError, apply_nccl_environment
from elastic.worker.sliced import wait_sliced

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend as C10dBackend


def available() -> bool:
    return hasattr(dist, "ProcessGroupNCCL") and dist.is_nccl_available()


def new_group(store: dist.Store, rank: int, size: int, device_index: int,
              timeout_s: float) -> C10dBackend:
    """An NCCL group bound to ``cuda:device_index``, its communicator connected now."""
    if not available():
        raise PlacementError("this torch build has no NCCL")
    import torch
    apply_nccl_environment()
    device = torch.device("cuda", device_index)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout_s)
    group = dist.ProcessGroupNCCL(store, rank, size, options)
    if hasattr(group, "bound_device_id"):
        group.bound_device_id = device
    if hasattr(group, "eager_connect_single_device"):
        group.eager_connect_single_device(device)
    return group


def abort(group: object) -> bool:
    """Abort ``group``'s communicators so that no stream stays blocked on a dead
    peer. Returns whether this torch offered a way to do so."""
    for name in ("abort", "_abort", "shutdown"):
        method = getattr(group, name, None)
        if method is not None:
            try:
                method()
            except Exception:  # noqa: BLE001 - an already broken communicator
                pass
            return True
    return False


def wait_polling(work: dist.Work, slice_s: float, deadline_s: float,
                 aborted: Callable[[], bool], what: str = "collective",
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 on_abandon: Callable[[], None] | None = None) -> None:
    """Wait for NCCL ``work`` without ever blocking the CPU unboundedly: poll
    ``is_completed()`` in slices (sliced.wait_sliced), watching ``aborted()``."""

    def completed() -> bool:
        try:
            return work.is_completed()
        except Exception as exc:  # noqa: BLE001 - a failed work means a peer is gone
            raise WorkersDepartedError(f"{what} failed: {exc}") from exc

    # Short first slices: most work completes within microseconds.
    wait_sliced(completed, aborted, deadline_s, what, slice_s=slice_s, first_s=50e-6,
                clock=clock, sleep=sleep, on_abandon=on_abandon)
    try:
        work.wait()     # completed: only orders the current stream after it, or raises
    except Exception as exc:  # noqa: BLE001
        raise WorkersDepartedError(f"{what} failed: {exc}") from exc
