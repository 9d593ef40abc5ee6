"""Shaped like Horovod's pytorch_imagenet_resnet50_elastic.py: same hvd calls and keywords
(backward_passes_per_step, gradient_predivide_factor, check_host_updates, Metric with
hvd.allreduce(name=...)). Rank 1 dies once mid-epoch: the survivors train on."""

import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import elastic.torch as hvd  # was: import horovod.torch as hvd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import crash_once, images, report  # noqa: E402

EPOCHS, BATCH, PER_ALLREDUCE, BASE_LR, WD = 2, 4, 2, 0.0125, 5e-5
BATCHES_PER_COMMIT, BATCHES_PER_HOST_CHECK, PREDIVIDE = 2, 1, 2.0
CRASH = os.environ.get("HVD_EXAMPLE_CRASH") == "1"

hvd.init()
torch.manual_seed(42)
allreduce_batch_size = BATCH * PER_ALLREDUCE
train_dataset = images(96, 3, 16)
train_sampler = hvd.elastic.ElasticSampler(train_dataset)
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=allreduce_batch_size,
                                           sampler=train_sampler)
val_dataset = images(32, 3, 16, seed=1)
val_sampler = hvd.elastic.ElasticSampler(val_dataset)
val_loader = torch.utils.data.DataLoader(val_dataset, batch_size=BATCH, sampler=val_sampler)

model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
lr_scaler = PER_ALLREDUCE * hvd.size()
optimizer = optim.SGD(model.parameters(), lr=(BASE_LR * lr_scaler), momentum=0.9,
                      weight_decay=WD)
compression = hvd.Compression.none
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), compression=compression,
    backward_passes_per_step=PER_ALLREDUCE, op=hvd.Average,
    gradient_predivide_factor=PREDIVIDE)


class Metric:
    def __init__(self, name):
        self.name = name
        self.sum = torch.tensor(0.)
        self.n = torch.tensor(0.)

    def update(self, val):
        self.sum += hvd.allreduce(val.detach().cpu(), name=self.name)
        self.n += 1

    @property
    def avg(self):
        return self.sum / self.n


def adjust_learning_rate(epoch, batch_idx):
    lr_adj = 1. if epoch < 1 else 1e-1
    for param_group in optimizer.param_groups:
        param_group["lr"] = BASE_LR * hvd.size() * PER_ALLREDUCE * lr_adj


@hvd.elastic.run
def full_train(state):
    while state.epoch < EPOCHS:
        train(state)
        validate(state.epoch)
        end_epoch(state)


def train(state):
    model.train()
    epoch = state.epoch
    train_loss = Metric("train_loss")
    state.train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        crash_once("imagenet", hvd.rank(), CRASH and epoch == 0 and state.batch >= 3)
        adjust_learning_rate(epoch, batch_idx)
        optimizer.zero_grad()
        for i in range(0, len(data), BATCH):
            data_batch, target_batch = data[i:i + BATCH], target[i:i + BATCH]
            output = model(data_batch)
            loss = F.cross_entropy(output, target_batch)
            train_loss.update(loss)
            loss.div_(math.ceil(float(len(data)) / BATCH))
            loss.backward()
        optimizer.step()
        state.train_sampler.record_batch(batch_idx, allreduce_batch_size)
        state.batch = batch_idx + 1
        if BATCHES_PER_COMMIT > 0 and state.batch % BATCHES_PER_COMMIT == 0:
            state.commit()
        elif BATCHES_PER_HOST_CHECK > 0 and state.batch % BATCHES_PER_HOST_CHECK == 0:
            state.check_host_updates()


def validate(epoch):
    model.eval()
    val_loss = Metric("val_loss")
    with torch.no_grad():
        for data, target in val_loader:
            val_loss.update(F.cross_entropy(model(data), target))
    if hvd.rank() == 0:
        print(f"epoch {epoch} val_loss {float(val_loss.avg):.4f}")


def end_epoch(state):
    state.epoch += 1
    state.batch = 0
    state.train_sampler.set_epoch(state.epoch)
    state.commit()


def on_state_reset():
    for param_group in optimizer.param_groups:
        param_group["lr"] = BASE_LR * hvd.size()


resume_from_epoch = 0
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, train_sampler=train_sampler,
                               val_sampler=val_sampler, epoch=resume_from_epoch, batch=0)
state.register_reset_callbacks([on_state_reset])
full_train(state)
views = all(any(p.grad.untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
                for f in optimizer.bucket_flats) for p in model.parameters())
report("imagenet_resnet50_elastic", hvd.rank(), size=hvd.size(), views=views,
       params=[float(p.detach().sum()) for p in model.parameters()])
