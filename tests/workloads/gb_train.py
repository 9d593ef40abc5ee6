"""Training job for the constant-global-batch tests: two float64 models side by side.

"global":   constant-global-batch mode, G samples per step at any world size.
"ordinary": per-worker batch fixed, so a step's sample count follows the world size.
Both take one optimizer step per loop iteration, through one DistributedOptimizer,
and are committed together, so a membership change hits both at the same step.

Writes to $JOB_OUT:
  steps.<worker>.jsonl  one line per step: step, rank, size, round, host
  final.<rank>.json     both models' parameters, the initial ones, each step's global batch
Holds: GB_HOLD="3,5" keeps committing at those steps until the membership changes
(or $JOB_OUT/go.<step> appears), so a test changes hosts at known steps.
"""

import json
import os

import torch
from job_helpers import hold_or_commit, train_global_batches

import elastic

OUT = os.environ["JOB_OUT"]
STEPS = int(os.environ.get("GB_STEPS", "9"))
SAMPLES = int(os.environ.get("GB_SAMPLES", "25"))
GLOBAL_BATCH = int(os.environ.get("GB_GLOBAL_BATCH", "10"))
MICRO = int(os.environ.get("GB_MICRO", "2"))
WORKER_BATCH = int(os.environ.get("GB_WORKER_BATCH", "3"))
HOLDS = {int(s) for s in os.environ.get("GB_HOLD", "").split(",") if s}
WID = os.environ.get("ELASTIC_WORKER_ID", "solo")


def flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()]).tolist()


def net():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1)).double()


def main():
    elastic.init()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=gen, dtype=torch.float64)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(
        SAMPLES, 1, generator=gen, dtype=torch.float64)
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"global": net(), "ordinary": net()})
    initial = flat(model["global"])
    opt = elastic.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters())
    sampler = elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=1,
                                     global_batch_size=GLOBAL_BATCH)
    ord_sampler = elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=1)
    state = elastic.TorchState(model, opt, sampler=sampler, ord_sampler=ord_sampler,
                               epoch=0, ord_epoch=0, step=0, batches=[])
    log = open(os.path.join(OUT, f"steps.{WID}.jsonl"), "a", buffering=1)
    mse = torch.nn.functional.mse_loss

    def ordinary_batch():
        while True:
            state.ord_sampler.set_epoch(state.ord_epoch)
            idx = state.ord_sampler.get_indices(0, WORKER_BATCH)
            if idx:
                return idx
            state.ord_epoch += 1

    def train_step(batch):
        step = state.step + 1
        opt.zero_grad()
        for micro in batch:     # this rank's share of the global batch
            micro.backward(mse(model["global"](x[micro.indices]), y[micro.indices]))
        idx = ordinary_batch()
        mse(model["ordinary"](x[idx]), y[idx]).backward()
        opt.step()
        state.sampler.record_global_batch()
        state.ord_sampler.record_indices(idx)
        state.step = step
        state.batches.append(batch.global_indices)
        w = elastic.worker.runtime.worker()
        log.write(json.dumps({"step": step, "rank": elastic.rank(), "size": elastic.size(),
                              "round": w.round_id if w else 0, "local_rank": elastic.local_rank(),
                              "host": os.environ.get("ELASTIC_HOSTNAME", ""),
                              "share": len(batch.indices), "worker": WID}) + "\n")
        hold_or_commit(state, step, HOLDS, OUT)

    @elastic.run
    def train(state):
        train_global_batches(state, opt, STEPS, MICRO, train_step)

    train(state)
    rank = elastic.rank()
    with open(os.path.join(OUT, f"final.{rank}.json"), "w") as f:
        json.dump({"params": {k: flat(m) for k, m in model.items()}, "initial": initial,
                   "global_batches": state.batches, "step": state.step,
                   "size": elastic.size(), "worker": WID}, f)


if __name__ == "__main__":
    main()
