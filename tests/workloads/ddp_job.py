"""A torchrun-style DDP script made elastic: the workload of tests/test_torch_distributed.py.

Trains a float64 model wrapped in elastic.DDP (one bucket per parameter, so
buckets overlap backward; DDP_BUCKET_MB overrides the cap) in constant-global-batch
mode: every step trains the same G samples at any world size, in micro-batches that accumulate under
no_sync(). At the first step of every round it checks the torchrun contract
(default group, environment, dist.* collectives, new_group) and that a
collective on the previous round's group raises WorkersDepartedError.

Writes to $JOB_OUT: steps.<worker>.jsonl (one line per step, with the contract
checks), final.<rank>.json (parameters, optimizer digest, global batches).
DDP_HOLD="3,5" keeps committing at those steps until the membership changes;
DDP_KILL=step:rank SIGKILLs that rank once, mid-backward; DDP_HOOK=fp16 registers
torch's fp16 compression hook, wrapped so that each step's line also carries its
"order": "L" when DDP launches a bucket's reduction, "G" when the first layer's
weight (whose gradient autograd computes last) gets its gradient. An "L" before
the last "G" is a bucket reduced while backward was still computing: overlap.
"""

import json
import os
import signal

import torch
import torch.distributed as dist
from job_helpers import digest, hold_or_commit, optimizer_tensors, train_global_batches

import elastic

OUT = os.environ["JOB_OUT"]
STEPS = int(os.environ.get("DDP_STEPS", "8"))
SAMPLES = 24
GLOBAL_BATCH = 6
MICRO = 1
HOLDS = {int(s) for s in os.environ.get("DDP_HOLD", "").split(",") if s}
KILL = os.environ.get("DDP_KILL", "")
WID = os.environ.get("ELASTIC_WORKER_ID", "solo")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT")


def check_contract(previous):
    """The torchrun contract in this round; returns what a test asserts on."""
    size, rank = elastic.size(), elastic.rank()
    env = {k: os.environ.get(k) for k in TORCHRUN_VARS}
    t = torch.ones(2, dtype=torch.float64)
    dist.all_reduce(t)
    dist.barrier()
    sub = dist.new_group(list(range(size)))
    s = torch.full((1,), float(rank + 1))
    dist.all_reduce(s, group=sub)
    gathered = [None] * size
    dist.all_gather_object(gathered, rank)
    ended = None
    if previous is not None:
        try:
            dist.all_reduce(torch.ones(1), group=previous)
            ended = "no error"
        except elastic.WorkersDepartedError:
            ended = "WorkersDepartedError"
    return {"initialized": dist.is_initialized(), "dist_rank": dist.get_rank(),
            "dist_size": dist.get_world_size(), "backend": dist.get_backend(), "env": env,
            "all_reduce": t.tolist(), "subgroup": s.item(), "gathered": gathered,
            "ended_group": ended}


def launch_recorder(hook, order):
    """The comm hook, noting in ``order`` each bucket launch (DDP calls the hook then)."""
    def launch(state, bucket):
        order.append("L")
        return hook(state, bucket)
    launch.__name__ = hook.__name__
    return launch


def main():
    elastic.init()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=gen, dtype=torch.float64)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 1)).double()
    model = elastic.DDP(net, bucket_cap_mb=float(os.environ.get("DDP_BUCKET_MB", "1e-6")))
    order = []                                          # this step's "L"/"G" events
    if os.environ.get("DDP_HOOK") == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, launch_recorder(default_hooks.fp16_compress_hook, order))
        net[0].weight.register_hook(lambda grad: order.append("G"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=1,
                                     global_batch_size=GLOBAL_BATCH)
    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0, batches=[])
    log = open(os.path.join(OUT, f"steps.{WID}.jsonl"), "a", buffering=1)
    seen = {"round": None, "group": None}

    def train_step(batch):
        w = elastic.worker.runtime.worker()
        round_id = w.round_id if w else 0
        record = {"step": state.step + 1, "rank": elastic.rank(), "size": elastic.size(),
                  "round": round_id, "worker": WID}
        if round_id != seen["round"]:
            record["contract"] = check_contract(seen["group"])
            seen["round"], seen["group"] = round_id, dist.group.WORLD
        optimizer.zero_grad()
        order.clear()
        for micro in batch:
            loss = torch.nn.functional.mse_loss(model(x[micro.indices]), y[micro.indices])
            if KILL and micro.last and KILL == f"{state.step + 1}:{elastic.rank()}" and \
                    not os.path.exists(os.path.join(OUT, "killed")):
                open(os.path.join(OUT, "killed"), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)     # peers are in this backward
            micro.backward(loss)
        optimizer.step()
        state.sampler.record_global_batch()
        state.step += 1
        state.batches.append(batch.global_indices)
        record["rebinds"] = model.rebinds
        record["order"] = "".join(order)
        log.write(json.dumps(record) + "\n")
        hold_or_commit(state, state.step, HOLDS, OUT)

    @elastic.run
    def train(state):
        train_global_batches(state, model, STEPS, MICRO, train_step)

    train(state)
    with open(os.path.join(OUT, f"final.{elastic.rank()}.json"), "w") as f:
        json.dump({"params": [p.detach().flatten().tolist() for p in net.parameters()],
                   "digest": digest(list(net.parameters())),
                   "optimizer": digest(optimizer_tensors(optimizer)),
                   "sampler": state.sampler.state_dict(), "batches": state.batches,
                   "step": state.step, "size": elastic.size(), "worker": WID}, f)


if __name__ == "__main__":
    main()
