"""Shaped like Horovod's examples/pytorch/pytorch_mnist.py (not elastic): same hvd calls."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import elastic.torch as hvd  # was: import horovod.torch as hvd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import images, report  # noqa: E402

EPOCHS, BATCH, LR, MOMENTUM, PREDIVIDE, USE_ADASUM = 2, 8, 0.01, 0.5, 1.0, False

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)
train_dataset = images(64, 1, 28)
train_sampler = torch.utils.data.distributed.DistributedSampler(
    train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=BATCH, sampler=train_sampler)
test_dataset = images(32, 1, 28, seed=1)
test_sampler = torch.utils.data.distributed.DistributedSampler(
    test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=BATCH, sampler=test_sampler)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
        self.fc1 = nn.Linear(4 * 12 * 12, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        return F.log_softmax(self.fc1(x.flatten(1)), dim=1)


model = Net()
lr_scaler = hvd.size() if not USE_ADASUM else 1
if USE_ADASUM and hvd.nccl_built():
    lr_scaler = hvd.local_size()
optimizer = optim.SGD(model.parameters(), lr=LR * lr_scaler, momentum=MOMENTUM)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
compression = hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if USE_ADASUM else hvd.Average,
                                     gradient_predivide_factor=PREDIVIDE)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    for data, target in train_loader:
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()


def test():
    model.eval()
    test_loss, test_accuracy = 0., 0.
    for data, target in test_loader:
        output = model(data)
        test_loss += F.nll_loss(output, target, reduction="sum").item()
        pred = output.data.max(1, keepdim=True)[1]
        test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum()
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)
    return metric_average(test_loss, "avg_loss"), metric_average(test_accuracy, "avg_accuracy")


for epoch in range(1, EPOCHS + 1):
    train(epoch)
    loss, accuracy = test()
report("mnist", hvd.rank(), size=hvd.size(), loss=loss,
       params=[float(p.detach().sum()) for p in model.parameters()])
