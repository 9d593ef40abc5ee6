"""Which backend carries a worker's tensors, which GPU it trains on, and how it waits.

Pure rules, so that they are tested without a GPU (tests/test_devices.py):

* NCCL needs one GPU per worker. A host given more slots than it has GPUs is a
  configuration error that repeats on every round, so it is raised once as a
  ``PlacementError`` and never turned into ``WorkersDepartedError`` (which the
  run loop would retry forever).
* ``ELASTIC_BACKEND=gloo`` carries CUDA tensors over gloo, so several workers may
  share a GPU (for tests and small jobs).
* NCCL work completes its future when the kernel is enqueued, and ``wait()``
  only makes the current stream wait. A bounded wait therefore polls
  ``is_completed()``; gloo work can wait on its future.
* NCCL's watchdog must not end a survivor whose peer died: the runtime aborts
  the communicators of an aborted round itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastic.exceptions import ElasticError

if TYPE_CHECKING:
    import torch

ENV_BACKEND = "ELASTIC_BACKEND"
BACKENDS = ("auto", "gloo", "nccl")

# Set for NCCL workers unless the user chose otherwise. 2 = abort the
# communicator on an error but do not tear the process down; the run loop then
# sees WorkersDepartedError and rejoins.
NCCL_ENV_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",   # the heartbeat monitor would kill a waiting survivor
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}


class PlacementError(ElasticError):
    """A device or backend configuration that will fail the same way on every round."""


@dataclass(frozen=True)
class Placement:
    """Where one worker's data plane runs."""

    backend: str                   # "gloo" or "nccl": the device group's backend
    device: int | None          # the CUDA device index to make current, or None (CPU)

    @property
    def wait_mode(self) -> str:
        return wait_mode(self.backend)

    @property
    def cuda_device(self) -> int:
        """``device``, where a GPU is needed (an NCCL placement always has one)."""
        if self.device is None:
            raise PlacementError(f"a {self.backend} placement on the CPU has no CUDA device")
        return self.device


def choose_backend(requested: str, cuda_available: bool) -> str:
    """The device group's backend for ``ELASTIC_BACKEND=requested``."""
    requested = (requested or "auto").strip().lower()
    if requested not in BACKENDS:
        raise PlacementError(f"{ENV_BACKEND}={requested!r}: expected one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "nccl" if cuda_available else "gloo"
    if requested == "nccl" and not cuda_available:
        raise PlacementError(f"{ENV_BACKEND}=nccl but this torch build sees no CUDA device "
                             "or has no NCCL")
    return requested


def place(requested: str, local_rank: int, local_size: int, device_count: int,
          hostname: str = "this host") -> Placement:
    """The placement of the worker ``local_rank`` of ``local_size`` on a host with
    ``device_count`` GPUs."""
    backend = choose_backend(requested, device_count > 0)
    if backend == "nccl":
        if local_size > device_count:
            raise PlacementError(
                f"{hostname} runs {local_size} workers but has {device_count} GPU(s); NCCL needs "
                f"one GPU per worker: give it at most {device_count} slots, or set "
                f"{ENV_BACKEND}=gloo to share GPUs")
        return Placement("nccl", local_rank)
    if device_count == 0:
        return Placement("gloo", None)
    return Placement("gloo", local_rank % device_count)


def wait_mode(backend: str) -> str:
    """"poll": watch ``work.is_completed()`` in slices; "future": wait on the work's future."""
    return "poll" if backend == "nccl" else "future"


def nccl_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL settings to add to ``environ``: our defaults where the user set none."""
    return {k: v for k, v in NCCL_ENV_DEFAULTS.items() if k not in environ}


def apply_nccl_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set the NCCL defaults before the first NCCL group is created."""
    environ.update(nccl_environment(environ))


# Messages of errors that come back the same on every attempt: retrying them by
# rejoining a new round would loop forever.
_REPEATING = (
    "duplicate gpu", "same cuda device", "invalid usage", "unsupported dtype",
    "invalid scalar type", "mismatch", "does not match",
)


def is_repeating_error(exc: BaseException) -> bool:
    """Whether ``exc`` will repeat on every attempt (a configuration or usage error),
    rather than mean that a peer is gone."""
    if isinstance(exc, (PlacementError, TypeError, ValueError)):
        return True
    text = str(exc).lower()
    return any(marker in text for marker in _REPEATING)


def distinct_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The CUDA devices that ``tensors`` live on, each once, in first-seen order."""
    seen: list[torch.device] = []
    for t in tensors:
        if getattr(t, "is_cuda", False) and t.device not in seen:
            seen.append(t.device)
    return seen


def synchronize_devices(tensors: Iterable[torch.Tensor]) -> int:
    """Wait for the work queued on every device where ``tensors`` live (one
    synchronize per device, not only the current one). Returns how many."""
    devices = distinct_devices(tensors)
    if devices:
        import torch
        for device in devices:
            torch.cuda.synchronize(device)
    return len(devices)
