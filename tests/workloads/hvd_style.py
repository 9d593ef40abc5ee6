"""A Horovod elastic script, unchanged except for its import line."""

import json
import os
import sys

import torch

import elastic.torch as hvd  # was: import horovod.torch as hvd

OUT = os.environ["JOB_OUT"]
hvd.init()
torch.manual_seed(hvd.rank())
model = torch.nn.Linear(6, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.fp16)
data = torch.randn(96, 6)
target = data.sum(1, keepdim=True)
sampler = hvd.elastic.ElasticSampler(list(range(96)), shuffle=False)


def on_state_reset():
    for group in optimizer.param_groups:
        group["lr"] = 0.01 * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
state.register_reset_callbacks([on_state_reset])


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, 3):  # noqa: B020 - Horovod's idiom, on purpose
        state.sampler.set_epoch(state.epoch)
        idx = list(state.sampler)
        for start in range(0, len(idx), 4):
            batch = idx[start:start + 4]
            if state.batch == 4 and hvd.rank() == 1 and not os.path.exists(f"{OUT}/crashed"):
                open(f"{OUT}/crashed", "w").close()
                os._exit(1)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(data[batch]), target[batch]).backward()
            optimizer.step()
            state.sampler.record_batch(start, len(batch))
            state.batch += 1
            with open(f"{OUT}/sizes.{os.environ['HOROVOD_HOSTNAME']}.txt", "a") as f:
                f.write(f"{hvd.size()}\n")
            if state.batch == 8:
                # Hold until the test adds hosts; rank 0 decides so all ranks agree.
                while not hvd.broadcast_object(os.path.exists(f"{OUT}/go"), root_rank=0):
                    state.commit()
            state.commit()


try:
    train(state)
except hvd.HorovodInternalError:
    sys.exit(2)
digest = hvd.allgather_object(
    [round(float(v), 6) for v in torch.cat([p.flatten() for p in model.parameters()])])
if hvd.rank() == 0:
    with open(f"{OUT}/result.json", "w") as f:
        json.dump({"size": hvd.size(), "equal": all(d == digest[0] for d in digest)}, f)
