"""One DDP training script for the ddp bench rows (ddp_bench.py), run unchanged under
elasticrun (the round's default group) and under torchrun (its own init_process_group).

argv: mode=ddp|dopt steps=N commit_every=K warmup=W
Writes $BENCH_OUT/steps.<worker>.jsonl (step, rank, size, t) and, on rank 0 after the
last step, $BENCH_OUT/steady.json with the timed steps' seconds (after the warm-up).
BENCH_STEP_SLEEP adds a sleep per step (the change-pause rows); BENCH_HOLD_FILE keeps
the job training until that file exists.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import elastic

ARGS = dict(a.split("=", 1) for a in sys.argv[1:])
MODE = ARGS.get("mode", "ddp")
STEPS = int(ARGS.get("steps", "60"))
COMMIT_EVERY = int(ARGS.get("commit_every", "10"))
WARMUP = int(ARGS.get("warmup", "10"))
OUT = os.environ["BENCH_OUT"]
SLEEP = float(os.environ.get("BENCH_STEP_SLEEP", "0"))
HOLD = os.environ.get("BENCH_HOLD_FILE")


def main():
    under_elastic = "ELASTIC_STORE_ADDR" in os.environ
    if under_elastic:
        elastic.init()
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                              torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                              torch.nn.Linear(1024, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if MODE == "ddp":
        model, opt = elastic.DDP(net), optimizer
    else:
        model = net
        opt = elastic.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
    state = elastic.TorchState(net, optimizer, step=0)
    wid = os.environ.get("ELASTIC_WORKER_ID", os.environ.get("RANK", "0"))
    log = open(os.path.join(OUT, f"steps.{wid}.jsonl"), "a", buffering=1)
    x = torch.randn(32, 256)
    y = torch.randint(0, 10, (32,))
    times = []

    @elastic.run
    def train(state):
        while state.step < STEPS or (HOLD and not os.path.exists(HOLD)):
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()
            if state.step > WARMUP:
                times.append(time.perf_counter() - t0)
            w = elastic.worker.runtime.worker()
            log.write(json.dumps({"step": state.step, "rank": elastic.rank(),
                                  "size": elastic.size(), "round": w.round_id if w else 0,
                                  "t": time.time()}) + "\n")
            if SLEEP:
                time.sleep(SLEEP)

    train(state)
    if dist.get_rank() == 0:           # torchrun's rank, or the round's (its default group)
        with open(os.path.join(OUT, "steady.json"), "w") as f:
            json.dump({"step_s": times}, f)
    if not under_elastic:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
