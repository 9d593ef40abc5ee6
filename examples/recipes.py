"""Common recipes inside @elastic.run, all in one script, each kept across membership changes:

1. AMP: ``torch.autocast`` (bfloat16 on CPU) with a ``GradScaler`` whose state is committed.
2. Gradient clipping: ``synchronize()`` first, so every rank clips the same averaged
   gradients, then ``skip_synchronize()`` for the step.
3. ``torch.compile`` of the model: compiled once per shape, never again for a new round.
4. A ``DataLoader`` with ``num_workers=2`` and ``persistent_workers=True`` over an
   ``ElasticSampler``: each sample trained once per epoch across changes.
5. An LR scheduler with ``LRScaler``: the scheduler sees the unscaled lr; the step uses
   it times the world-size factor.

    elasticrun -np 2 --min-np 1 --max-np 4 -H localhost:4 python examples/recipes.py

``--out DIR`` writes what tests/test_recipes.py checks (one line per step, and the
final state); ``--hold N`` keeps committing at step N until the world changes.
"""

import argparse
import hashlib
import json
import os
import time

import torch

import elastic

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend; 'counting' counts compilations (tests)")
parser.add_argument("--out", default=None)
parser.add_argument("--hold", type=lambda s: {int(x) for x in s.split(",") if x}, default=set())
ARGS = parser.parse_args()
COMPILES = [0]


def counting_backend(graph_module, example_inputs):
    COMPILES[0] += 1
    return graph_module.forward


def main():
    torch.manual_seed(0)
    x = torch.randn(96, 8)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    dataset = torch.utils.data.TensorDataset(torch.arange(96), x, y)

    elastic.init()
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    backend = counting_backend if ARGS.compile_backend == "counting" else ARGS.compile_backend
    compiled = torch.compile(model, backend=backend)                      # recipe 3
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dist_opt = elastic.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    lr_scaler = elastic.LRScaler(dist_opt, base_size=2, rule="linear")   # recipe 5
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)  # 1
    sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler,  # recipe 4
                                         num_workers=2, persistent_workers=True)
    state = elastic.TorchState(model, optimizer, sampler=sampler, schedule=schedule,
                               grad_scaler=grad_scaler, epoch=0, step=0, history=[])
    state.register_reset_callbacks([lr_scaler])
    out = open(os.path.join(ARGS.out, f"steps.{os.environ.get('ELASTIC_WORKER_ID', 'solo')}"
                                      ".jsonl"), "a", buffering=1) if ARGS.out else None
    shapes = set()

    @elastic.run
    def train(state):
        while state.epoch < ARGS.epochs:
            state.sampler.set_epoch(state.epoch)
            for i, (ids, xb, yb) in enumerate(loader):
                dist_opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):               # recipe 1
                    loss = torch.nn.functional.binary_cross_entropy_with_logits(
                        compiled(xb).float(), yb)
                shapes.add(tuple(xb.shape))
                grad_scaler.scale(loss).backward()
                dist_opt.synchronize()                  # average first: every rank then
                grad_scaler.unscale_(dist_opt)          # finds the same inf/nan and clips
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # recipe 2
                with dist_opt.skip_synchronize():
                    grad_scaler.step(dist_opt)
                grad_scaler.update()
                schedule.step()
                state.sampler.record_batch(i, loader.batch_size)
                state.step += 1
                state.history.append([state.epoch, state.step,
                                      sorted(elastic.allgather(ids).tolist())])
                if out:
                    out.write(json.dumps({
                        "step": state.step, "rank": elastic.rank(), "size": elastic.size(),
                        "compiles": COMPILES[0], "shapes": len(shapes),
                        "lr": optimizer.param_groups[0]["lr"],
                        "scaled_lr": lr_scaler.scaled_lrs()[0]}) + "\n")
                hold(state) if state.step in ARGS.hold else state.commit()
            state.epoch += 1
            state.commit()

    def hold(state):
        """Keep committing (rank 0 decides when to stop) until the world changes."""
        while True:
            state.commit()
            go = torch.tensor([int(os.path.exists(os.path.join(ARGS.out, "go")))])
            if int(elastic.broadcast(go, 0)):
                return
            time.sleep(0.05)

    train(state)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    if out:
        with open(os.path.join(ARGS.out, f"final.{elastic.rank()}.json"), "w") as f:
            json.dump({"params": digest, "scaler": grad_scaler.state_dict(),
                       "schedule": schedule.state_dict(), "history": state.history,
                       "size": elastic.size(), "step": state.step}, f)
    if elastic.rank() == 0:
        print(f"trained {state.step} steps on {elastic.size()} workers; params {digest[:12]}")


if __name__ == "__main__":
    main()
