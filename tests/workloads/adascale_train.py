"""Real-job AdaScale training for tests/test_adascale.py: the least-squares problem of
adascale_problem.py through a DistributedOptimizer and LRScaler(rule="adascale"),
trained until TOTAL scale-invariant iterations, with the scaler and its driven StepLR
in the committed state.

Writes to $JOB_OUT:
  steps.<worker>.jsonl  one line per step and rank: step, rank, size, round, progress,
                        gain, observations, loss (excess, after the step), local_sq (this
                        rank's local gradient, computed apart), reduced_sq, lr
  final.<rank>.json     progress, steps, the scaler's state, loss
Holds: ADA_HOLD="40,90" keeps committing at those steps until the membership changes
(or $JOB_OUT/go.<step> appears), so a test changes hosts at known steps.
ADA_DDP=1 reduces through elastic.DDP with the scaler's comm hook instead;
ADA_PASSES=k accumulates k backward passes per step (no_sync() under DDP,
backward_passes_per_step=k otherwise); ADA_TOTAL overrides the length.
"""

import contextlib
import json
import os

import adascale_problem as problem
import torch
from job_helpers import hold_or_commit

import elastic

OUT = os.environ["JOB_OUT"]
HOLDS = {int(s) for s in os.environ.get("ADA_HOLD", "").split(",") if s}
WID = os.environ.get("ELASTIC_WORKER_ID", "solo")
SEED = int(os.environ.get("ADA_SEED", "7"))
USE_DDP = os.environ.get("ADA_DDP") == "1"
PASSES = int(os.environ.get("ADA_PASSES", "1"))
TOTAL = int(os.environ.get("ADA_TOTAL", str(problem.TOTAL)))


def main():
    elastic.init()
    model, sgd = problem.model_and_optimizer()
    if USE_DDP:
        net, opt = elastic.DDP(model), sgd
        scaler = elastic.LRScaler(opt, base_size=1, rule="adascale", accumulation=PASSES)
        net.register_comm_hook(None, scaler.ddp_comm_hook)
    else:
        net = model
        opt = elastic.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                           backward_passes_per_step=PASSES)
        scaler = elastic.LRScaler(opt, base_size=1, rule="adascale")
    schedule = scaler.drive(torch.optim.lr_scheduler.StepLR(opt, step_size=problem.DECAY,
                                                            gamma=0.1))
    state = elastic.TorchState(model, opt, scaler=scaler, schedule=schedule, step=0)
    log = open(os.path.join(OUT, f"steps.{WID}.jsonl"), "a", buffering=1)

    def train_step():
        step, rank = state.step + 1, elastic.rank()
        gen = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1009 + rank)
        xs, ys = problem.batches(gen, PASSES)
        w = model.weight.detach().reshape(-1)
        local = sum(x.T @ (x @ w - y) for x, y in zip(xs, ys)) / (problem.B * PASSES)
        opt.zero_grad()             # local: what backward will give, computed apart
        for j, (x, y) in enumerate(zip(xs, ys)):
            local_only = USE_DDP and j < PASSES - 1      # forward and backward in no_sync()
            with net.no_sync() if local_only else contextlib.nullcontext():
                (0.5 * torch.nn.functional.mse_loss(net(x).reshape(-1), y) / PASSES).backward()
        lr = sgd.param_groups[0]["lr"]
        opt.step()
        state.step = step
        w = elastic.worker.runtime.worker()
        log.write(json.dumps({
            "step": step, "rank": rank, "size": elastic.size(), "round": w.round_id if w else 0,
            "progress": scaler.progress, "gain": scaler.gain,
            "observations": scaler.estimator.observations,
            "loss": problem.excess_loss(model.weight), "local_sq": float(local @ local),
            "reduced_sq": float((model.weight.grad * model.weight.grad).sum()), "lr": lr,
            "local_rank": elastic.local_rank(), "worker": WID}) + "\n")
        hold_or_commit(state, step, HOLDS, OUT)

    @elastic.run
    def train(state):
        while scaler.progress < TOTAL:
            train_step()

    train(state)
    with open(os.path.join(OUT, f"final.{elastic.rank()}.json"), "w") as f:
        json.dump({"progress": scaler.progress, "steps": state.step, "size": elastic.size(),
                   "scaler": scaler.state_dict(), "loss": problem.excess_loss(model.weight),
                   "worker": WID}, f)


if __name__ == "__main__":
    main()
