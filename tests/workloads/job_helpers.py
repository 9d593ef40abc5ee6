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


def hold_or_commit(state, step, holds, out):
    """After ``step``: hold there (until ``out``/go.<step> exists) if it is one of
    ``holds``, else commit."""
    if step in holds:
        hold(state, os.path.join(out, f"go.{step}"))
    else:
        state.commit()


def train_global_batches(state, owner, steps, micro_batch_size, train_step):
    """The constant-global-batch loop, as the body of an ``@elastic.run`` function:
    ``train_step(batch)`` for each global batch of ``state.sampler`` (``owner``: what
    ``global_batches`` scales, the optimizer or an elastic.DDP model) until ``state.step``
    reaches ``steps``, with a commit at each epoch's end."""
    while state.step < steps:
        state.sampler.set_epoch(state.epoch)
        for batch in state.sampler.global_batches(owner, micro_batch_size=micro_batch_size):
            train_step(batch)
            if state.step >= steps:
                return
        state.epoch += 1
        state.commit()


# -- checks a workload makes on every rank --------------------------------------------------
def raises(kinds, fn, *args, **kwargs):
    """The exception ``fn(*args, **kwargs)`` raised, which must be one of ``kinds``."""
    try:
        fn(*args, **kwargs)
    except kinds as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {kinds}")


def same(a, b):
    """``a`` and ``b`` are equal tensors, dtype and shape included."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(a, b), (a.flatten()[:8], b.flatten()[:8])
