"""Shaped like Horovod's pytorch_synthetic_benchmark_elastic.py: same hvd calls."""

import sys
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import elastic.torch as hvd  # was: import horovod.torch as hvd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import report  # noqa: E402

BATCH, WARMUP, PER_ITER, ITERS = 4, 1, 2, 3

hvd.init()
torch.set_num_threads(1)
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                      nn.Linear(8, 10))
lr_scaler = hvd.size()
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
compression = hvd.Compression.fp16
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression, op=hvd.Average)

data = torch.randn(BATCH, 3, 32, 32)
target = torch.LongTensor(BATCH).random_() % 10


def benchmark_step(state):
    state.optimizer.zero_grad()
    output = state.model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    state.optimizer.step()
    state.batch += 1


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "")


@hvd.elastic.run
def run_benchmark(state):
    if not state.warm:
        timeit.timeit(lambda: benchmark_step(state), number=WARMUP)
        state.warm = True
        state.commit()
    if state.iter == 0:
        log(f"Running benchmark... size {hvd.size()}")
    for x in range(state.iter, ITERS):
        t = timeit.timeit(lambda: benchmark_step(state), number=PER_ITER)
        img_sec = BATCH * PER_ITER / t
        log(f"Iter #{x}: {img_sec:.1f} img/sec per CPU")
        state.img_secs.append(img_sec)
        state.iter = x
        state.commit()


def on_state_reset():
    for param_group in optimizer.param_groups:
        param_group["lr"] = 0.01 * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, img_secs=[], iter=0, batch=0, warm=False)
state.register_reset_callbacks([on_state_reset])
run_benchmark(state)
img_sec_mean = np.mean(state.img_secs)
log(f"Img/sec per CPU: {img_sec_mean:.1f}")
report("synthetic_benchmark_elastic", hvd.rank(), size=hvd.size(), iters=len(state.img_secs),
       params=[float(p.detach().sum()) for p in model.parameters()])
