"""HF Accelerate inside @elastic.run: its Accelerator, prepared model, optimizer and
dataloader, rebuilt for every round (docs/torchrun.md, "HF Accelerate").

    elasticrun -np 2 --min-np 1 --max-np 4 -H localhost:4 python examples/train_accelerate.py

Accelerate reads the world once, when its state is created (PartialState: rank,
world size, device) and when it prepares objects (DDP on the default group, a
sampler sharded for that world). So at the start of each round, every rank drops
Accelerate's state and prepares again; TorchState holds the plain model and
optimizer, which Accelerate's wrappers share. The dataloader is prepared for one
process: the ElasticSampler already gives each rank its share (exactly once
across changes), and Accelerate's loader places each batch on its device. Give
the epoch to Accelerate's loader (``loader.set_epoch``), not to the sampler: the
loader sets its own count on the sampler at every pass, and a new round's loader
starts counting at 0.

``--out DIR`` writes what tests/test_accelerate.py checks; ``--kill-at N`` SIGKILLs
the last rank once at step N; ``--hold N`` keeps committing at step N until the world changes.
"""

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.state import AcceleratorState

import elastic

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--out", default=None)
parser.add_argument("--kill-at", type=int, default=0)
parser.add_argument("--hold", type=int, default=0)
ARGS = parser.parse_args()


class Prepared:
    """Accelerate's objects for the current round."""

    def __init__(self, model, optimizer, loader):
        AcceleratorState._reset_state(reset_partial_state=True)   # forget the last world
        self.group = dist.group.WORLD
        self.accelerator = Accelerator(cpu=True)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.loader = prepare_data_loader(loader, self.accelerator.device, num_processes=1,
                                          process_index=0, put_on_device=True)


def main():
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    y = x.sum(dim=1, keepdim=True)
    dataset = torch.utils.data.TensorDataset(torch.arange(96), x, y)

    elastic.init()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=5)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0, history=[])
    wid = os.environ.get("ELASTIC_WORKER_ID", "solo")
    out = open(os.path.join(ARGS.out, f"steps.{wid}.jsonl"), "a", buffering=1) if ARGS.out else None
    current = {}

    @elastic.run
    def train(state):
        if current.get("p") is None or current["p"].group is not dist.group.WORLD:
            current["p"] = Prepared(model, optimizer, loader)    # a new round
        p = current["p"]
        while state.epoch < ARGS.epochs:
            p.loader.set_epoch(state.epoch)    # Accelerate's loader passes it to the sampler
            for i, (ids, xb, yb) in enumerate(p.loader):
                p.optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(p.model(xb), yb)
                if state.step + 1 == ARGS.kill_at and p.accelerator.is_last_process and \
                        not os.path.exists(os.path.join(ARGS.out, "killed")):
                    open(os.path.join(ARGS.out, "killed"), "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                p.accelerator.backward(loss)
                p.optimizer.step()
                state.sampler.record_batch(i, loader.batch_size)
                state.step += 1
                state.history.append([state.epoch, state.step,
                                      sorted(elastic.allgather(ids).tolist())])
                if out:
                    out.write(json.dumps({
                        "step": state.step, "size": p.accelerator.num_processes,
                        "rank": p.accelerator.process_index, "device": str(p.accelerator.device),
                        "ddp": type(p.model).__name__}) + "\n")
                while state.step == ARGS.hold:           # until the world changes
                    state.commit()
                    time.sleep(0.05)
                state.commit()
            state.epoch += 1
            state.commit()

    train(state)
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes()
                                     for t in model.parameters())).hexdigest()
    if out:
        with open(os.path.join(ARGS.out, f"final.{elastic.rank()}.json"), "w") as f:
            json.dump({"params": digest, "history": state.history, "step": state.step,
                       "size": elastic.size()}, f)
    if elastic.rank() == 0:
        print(f"trained {state.step} steps on {elastic.size()} workers; params {digest[:12]}")


if __name__ == "__main__":
    main()
