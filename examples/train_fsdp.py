"""FSDP2 training whose shards survive a crash and follow a scale-up (docs/fsdp.md).

    elasticrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh \\
        python examples/train_fsdp.py --crash-at-step 4

Each worker holds a shard of the model and of AdamW's state, plus a copy of its
neighbour's. ``--crash-at-step N`` SIGKILLs the last rank once at step N: the
survivors rebuild the model on their smaller mesh and reshard the last commit
from their own memory. Hosts that discovery adds later receive only their shards.
A synthetic regression set, so it needs no download.
"""

import argparse
import os
import signal
import tempfile

import torch
from torch.distributed.fsdp import fully_shard

import elastic


def build(mesh):
    """The model, sharded on this round's mesh, and its optimizer (called every round)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--crash-at-step", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(480, 16)
    y = x @ torch.randn(16, 1)
    sampler = elastic.ElasticSampler(list(range(len(x))), global_batch_size=48)
    state = elastic.ShardedState(build, sampler=sampler, epoch=0, step=0)
    def crashed():     # one marker per job (its store's port), shared by its workers
        return os.path.join(tempfile.gettempdir(),
                            f"train_fsdp.{os.environ.get('MASTER_PORT')}.crashed")

    @elastic.run
    def train(state):
        while state.step < args.steps:
            state.sampler.set_epoch(state.epoch)
            while state.sampler.global_batches_left and state.step < args.steps:
                mine = state.sampler.share_of(state.sampler.global_batch_indices(0))
                state.optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(state.model(x[mine]), y[mine])
                loss.backward()
                state.optimizer.step()
                state.sampler.record_global_batch()
                state.step += 1
                if state.step == args.crash_at_step and elastic.rank() == elastic.size() - 1 \
                        and not os.path.exists(crashed()):
                    open(crashed(), "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)       # before this step's commit
                state.commit()
                if elastic.rank() == 0:
                    print(f"step {state.step}: {elastic.size()} workers, loss {loss.item():.4f}",
                          flush=True)
            if not state.sampler.global_batches_left:
                state.epoch += 1
                state.commit()

    train(state)


if __name__ == "__main__":
    main()
