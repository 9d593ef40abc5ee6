"""Horovod's build and runtime queries, answered for this implementation.

The data plane is torch.distributed: gloo always, NCCL when torch has it and a
GPU is used. There is no MPI, oneCCL, DDL or ROCm path here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic.worker import runtime


def gloo_built() -> bool:
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    return dist.is_gloo_available()


def nccl_built() -> int:
    """NCCL's version as Horovod reports it (e.g. 21903), or 0 when torch has no NCCL."""
    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a torch without a usable NCCL
        return 0
    return major * 10000 + minor * 100 + patch if major >= 2 and minor >= 9 \
        else major * 1000 + minor * 100 + patch


def mpi_built() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.backends.cuda.is_built()


def is_homogeneous() -> bool:
    """True when every host runs the same number of workers."""
    return runtime.local_size() * runtime.cross_size() == runtime.size()


_warned: set[str] = set()


def _warn_once(what: str) -> None:
    if what not in _warned:
        _warned.add(what)
        import warnings
        warnings.warn(f"elastic.torch: {what} is not provided and does nothing; elasticrun's "
                      "event log and timeline report replace Horovod's timeline", stacklevel=3)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Accepted so that Horovod scripts run; warns once and records nothing."""
    _warn_once("start_timeline")


def stop_timeline() -> None:
    _warn_once("stop_timeline")
