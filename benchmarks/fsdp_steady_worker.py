"""One FSDP2 training script for the fsdp steady-state row (run.py, section fsdpsteady),
run under elasticrun (elastic.ShardedState, a commit every K steps, redundancy 1) and
under torchrun (the plain FSDP2 loop on its own init_process_group, nothing committed).

argv: steps=N commit_every=K warmup=W
Writes $BENCH_OUT/steady.json on rank 0: the timed steps' seconds (after the warm-up).
"""

import functools
import json
import os
import sys
import time

import fsdp_bench  # noqa: I001 - benchmarks/ is sys.path[0]: the script's own folder
import torch
import torch.distributed as dist

import elastic

ARGS = dict(a.split("=", 1) for a in sys.argv[1:])
STEPS = int(ARGS.get("steps", "60"))
COMMIT_EVERY = int(ARGS.get("commit_every", "10"))
WARMUP = int(ARGS.get("warmup", "10"))
WIDTH, BATCH = 512, 32


build = functools.partial(fsdp_bench.build, width=WIDTH)     # the reshard row's MLP, narrower


def step(model, optimizer, x):
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def main():
    x = torch.randn(BATCH, WIDTH)
    times = []
    if "ELASTIC_STORE_ADDR" in os.environ:
        elastic.init()
        state = elastic.ShardedState(build, step=0)

        @elastic.run
        def train(state):
            while state.step < STEPS:
                t0 = time.perf_counter()
                step(state.model, state.optimizer, x)
                state.step += 1
                if state.step % COMMIT_EVERY == 0:
                    state.commit()
                if state.step > WARMUP:
                    times.append(time.perf_counter() - t0)

        train(state)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        dist.init_process_group("gloo")
        model, optimizer = build(init_device_mesh("cpu", (dist.get_world_size(),)))
        for i in range(STEPS):
            t0 = time.perf_counter()
            step(model, optimizer, x)
            if i + 1 > WARMUP:
                times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        with open(os.path.join(os.environ["BENCH_OUT"], "steady.json"), "w") as f:
            json.dump({"step_s": times}, f)
    if "ELASTIC_STORE_ADDR" not in os.environ:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
