"""What the checkpoint tests share: a small model, optimizer and sampler trained step by
step in this process, and real jobs of tests/workloads/ckpt_train.py."""

import torch

from elastic.training.sampler import ElasticSampler
from support.jobs import REPO, Job

WORKLOAD = REPO / "tests" / "workloads" / "ckpt_train.py"


def small_training(seed=0, freeze_first=False, width=16):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, width))
    if freeze_first:
        for p in model[0].parameters():
            p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    sampler = ElasticSampler(list(range(40)), shuffle=True, seed=3)
    return model, optimizer, sampler


def train_step(model, optimizer, sampler, i, width=16):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(4, width, generator=g)
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()
    sampler.record_batch(i, 4)


def ckpt_job(path, np, ckpt=None, env=None, hosts=None):
    args = ["-np", str(np), "-H", hosts or f"localhost:{np}"]
    if ckpt is not None:
        args += ["--checkpoint-dir", str(ckpt)]
    return Job(path, args, env=env, script=WORKLOAD)
