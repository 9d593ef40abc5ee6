"""A torchrun DDP script made elastic: the "after" side of docs/torchrun.md's diff.

    elasticrun -np 2 --min-np 1 --max-np 4 -H localhost:4 python examples/train_ddp.py
    python examples/train_ddp.py          # alone, as one worker

A synthetic regression set, so it needs no download.
"""

import argparse

import torch
import torch.distributed as dist

import elastic


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = x @ torch.randn(16, 1) + 0.01 * torch.randn(512, 1)
    dataset = torch.utils.data.TensorDataset(x, y)
    loss_fn = torch.nn.functional.mse_loss

    elastic.init()
    model = elastic.DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                            torch.nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = elastic.ElasticSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @elastic.run
    def train(state):
        while state.epoch < args.epochs:
            state.sampler.set_epoch(state.epoch)
            for i, (xb, yb) in enumerate(loader):
                optimizer.zero_grad()
                loss = loss_fn(model(xb), yb)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch(i, loader.batch_size)
                state.commit()
            world = dist.get_world_size() if dist.is_initialized() else 1
            if elastic.rank() == 0:
                print(f"epoch {state.epoch}: {world} workers, loss {loss.item():.4f}", flush=True)
            state.epoch += 1
            state.commit()

    train(state)


if __name__ == "__main__":
    main()
