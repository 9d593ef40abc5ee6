"""Pieces the test workloads share (importable: a script's folder is on sys.path)."""

import hashlib
import os
import time

import torch

import elastic


def digest(tensors):
    """sha256 over the tensors' bytes: equal digests mean bitwise-equal tensors."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def job_device():
    """JOB_DEVICE=cuda puts the model and data on this worker's GPU (make gpu-check)."""
    name = os.environ.get("JOB_DEVICE", "cpu")
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def optimizer_tensors(opt):
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for key in sorted(opt.state.get(p, {})):
                v = opt.state[p][key]
                out.append(v if torch.is_tensor(v) else torch.tensor(float(v)))
    return out


def hold(state, go_file):
    """Keep committing until ``go_file`` exists; rank 0 decides, so every rank agrees.

    A pending round interrupts the hold (commit raises HostsUpdatedInterrupt),
    which is how a test changes membership at a known step without racing.
    """
    while True:
        state.commit()
        go = torch.tensor([1 if os.path.exists(go_file) else 0])
        if int(elastic.broadcast(go, 0)):
            return
        time.sleep(0.05)
