"""Synthetic stand-ins for torchvision data, shared by the Horovod-example stand-ins."""

import json
import os

import torch
from torch.utils.data import TensorDataset


def images(n, channels, side, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, channels, side, side, generator=g),
                         torch.randint(0, classes, (n,), generator=g))


def report(name, rank, **values):
    """Each rank writes what the test checks: $JOB_OUT/<name>.<pid>.json."""
    out = os.environ.get("JOB_OUT")
    if out:
        with open(os.path.join(out, f"{name}.{os.getpid()}.json"), "w") as f:
            json.dump(dict(rank=rank, **values), f)


def crash_once(tag, rank, when):
    """SIGKILL-like exit of rank 1 once per job, to force a membership change."""
    out = os.environ.get("JOB_OUT")
    flag = os.path.join(out, f"crashed.{tag}") if out else None
    if when and rank == 1 and flag and not os.path.exists(flag):
        open(flag, "w").close()
        os._exit(1)
