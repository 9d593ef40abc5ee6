"""What the DistributedOptimizer tests share: a tiny model, its batches, a training loop,
and a fake peer (FakeComm) that stands in for the collectives without processes."""

import torch

from elastic.exceptions import WorkersDepartedError
from elastic.worker import collectives, runtime


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def batch_of(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(7, 6, generator=g), torch.randn(7, 3, generator=g)


def train_steps(model, opt, steps=5, k=1):
    for step in range(steps):
        opt.zero_grad()
        for micro in range(k):
            x, y = batch_of(10 * step + micro)
            ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class FakeWorker:
    def __init__(self):
        self.round_id = 1
        self.membership = runtime.Membership(rank=0, size=2)


class FakeComm:
    """Records launches; averages with a peer whose gradient equals ours times three."""

    def __init__(self, monkeypatch, worker):
        self.launched, self.fail = [], False
        monkeypatch.setattr(runtime, "worker", lambda: worker)
        monkeypatch.setattr(runtime, "ensure_joined", lambda: worker)
        monkeypatch.setattr(collectives, "allreduce_async", self.allreduce_async)
        monkeypatch.setattr(collectives, "synchronize", self.synchronize)

    def allreduce_async(self, tensor, op):
        self.launched.append(tensor)
        return tensor

    def synchronize(self, tensor):
        if self.fail:
            raise WorkersDepartedError("peer died")
        tensor.mul_(2)  # (g + 3g) / 2
