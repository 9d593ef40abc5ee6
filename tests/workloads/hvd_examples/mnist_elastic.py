"""Shaped like Horovod's examples/elastic/pytorch/pytorch_mnist_elastic.py: same hvd calls."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import elastic.torch as hvd  # was: import horovod.torch as hvd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import images, report  # noqa: E402

EPOCHS, BATCH, LR, MOMENTUM, BATCHES_PER_COMMIT = 2, 8, 0.01, 0.5, 2

hvd.init()
torch.manual_seed(42)
train_dataset = images(64, 1, 28)
train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=False)
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=BATCH, sampler=train_sampler)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
        self.fc1 = nn.Linear(4 * 12 * 12, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        return F.log_softmax(self.fc1(x.flatten(1)), dim=1)


model = Net()
lr_scaler = hvd.size()
optimizer = optim.SGD(model.parameters(), lr=LR * lr_scaler, momentum=MOMENTUM)
compression = hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression, op=hvd.Average)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, EPOCHS + 1):  # noqa: B020 (as Horovod writes it)
        state.model.train()
        train_sampler.set_epoch(state.epoch)
        steps_remaining = len(train_loader)
        for batch_idx, (data, target) in enumerate(train_loader):
            steps_remaining -= 1
            state.optimizer.zero_grad()
            output = state.model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            state.optimizer.step()
            if batch_idx % BATCHES_PER_COMMIT == 0:
                state.train_sampler.record_batch(batch_idx, BATCH)
                state.commit()
            state.batch = batch_idx
        state.batch = 0
        state.commit()


def on_state_reset():
    for param_group in optimizer.param_groups:
        param_group["lr"] = LR * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler, epoch=1, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
loss = metric_average(float(F.nll_loss(model(train_dataset.tensors[0][:8]).detach(),
                                       train_dataset.tensors[1][:8])), "avg_loss")
report("mnist_elastic", hvd.rank(), size=hvd.size(), loss=loss,
       params=[float(p.detach().sum()) for p in model.parameters()])
