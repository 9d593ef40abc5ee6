"""ShardedState (FSDP2) on 4 gloo workers: memory held, commit cost, reshard time.

One round of 4 workers (common.launch). An FSDP2 MLP with AdamW is trained a few
steps, then: the bytes each rank holds (its live shard, its commit and its
redundancy copy) against the full state; commits with redundancy 1 and 0 taking
turns; a reshard 3 -> 4 (ranks 0-2 hold a 3-way layout with their redundancy copies,
as ShardedState does, rank 3 is a newcomer; and again without copies) through
reshard.reshard, against the most bytes one rank received over the link bandwidth
measured in the same run, samples taking turns (gloo send/recv of that many bytes
between two ranks).
Writes $BENCH_OUT/result.<rank>.json. Usage: fsdp_bench.py REPS.
"""

import json
import os
import statistics
import sys
import time

import torch
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import elastic  # noqa: E402
from elastic.state import reshard, shard_plan  # noqa: E402
from elastic.worker import runtime  # noqa: E402

WIDTH, DEPTH = 1024, 4


def build(mesh, width=WIDTH, frozen=0):
    """The FSDP2 MLP of the fsdp rows (DEPTH x Linear(width, width), the first ``frozen``
    of them without gradients) and its AdamW."""
    torch.manual_seed(0)
    layers = []
    for i in range(DEPTH):
        linear = torch.nn.Linear(width, width)
        linear.requires_grad_(i >= frozen)
        layers += [linear, torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(state):
    state.optimizer.zero_grad()
    state.model(torch.randn(8, WIDTH)).sum().backward()
    state.optimizer.step()


def live_bytes(state):
    from elastic.state import fsdp_parts
    meta, sharded, _rest = fsdp_parts.split_live(state.model, state.optimizer)
    full = sum(shard_plan.row_numel(s) * s[0] * 4 for _k, s, _d in meta)
    return sum(t.numel() * t.element_size() for t in sharded.values()), full


def timed_reshard(group, me, n, meta, dest, redundancy):
    """3 -> n: ranks 0..2 hold what ShardedState holds after a commit at 3 workers (their
    shard of a 3-way layout and copies of their ``redundancy`` predecessors'), the others
    nothing; the parameters' rows land in the model in place, as ShardedState.sync does.
    Each rank's seconds from a common start to its own shard being complete."""
    held = {}
    if me < 3:
        for i in [me] + shard_plan.copies_kept(me, 3, redundancy):
            held[i] = reshard.shard_views(meta, 3, i, reshard.empty_shard(meta, 3, i))
    holders = {i: [i] + shard_plan.copy_targets(i, 3, redundancy) for i in range(3)}
    pieces = shard_plan.plan(meta, 3, holders, n)
    elastic.barrier()
    t0 = time.perf_counter()
    _out, got, sent = reshard.reshard(group, me, pieces, meta, 3, n, held, dest)
    return time.perf_counter() - t0, got, sent


def link_seconds(group, me, nbytes):
    """One gloo send/recv of ``nbytes`` from rank 0 to rank 1, between barriers."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    elastic.barrier()
    t0 = time.perf_counter()
    if me == 0:
        group.send([buf], 1, 7).wait()
    elif me == 1:
        group.recv([buf], 0, 7).wait()
    elastic.barrier()
    return time.perf_counter() - t0


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    elastic.init()
    state = elastic.ShardedState(build, redundancy=1)
    state.sync()
    for _ in range(3):
        step(state)
        state.commit()
    me, n = elastic.rank(), elastic.size()
    live, full = live_bytes(state)
    result = {"rank": me, "size": n, "live": live, "held": state.held_bytes(), "full": full,
              "commit": {"1": [], "0": []}}
    for i in range(reps):
        for degree in (("1", "0") if i % 2 == 0 else ("0", "1")):
            state.redundancy = int(degree)
            elastic.barrier()
            t0 = time.perf_counter()
            state.commit()
            result["commit"][degree].append(time.perf_counter() - t0)
    state.redundancy = 1
    gen = state.generations[-1]
    group = runtime.worker().cpu_group
    from elastic.state import fsdp_parts
    dest = fsdp_parts.local_params(state.model)
    # Reshard and bandwidth samples take turns, so that all see the same load.
    moves, bare, links = [], [], []
    most = 1
    for _ in range(max(7, reps // 2)):
        moves.append(timed_reshard(group, me, n, gen.meta, dest, 1))
        bare.append(timed_reshard(group, me, n, gen.meta, dest, 0))
        if len(moves) == 1:       # the baseline: most bytes one rank received, rank 0 -> 1
            most = max(elastic.allgather_object(moves[0][1]))
        links.append(link_seconds(group, me, most))
    result["reshard"] = [t for t, _g, _s in moves]
    result["reshard_received"], result["reshard_sent"] = moves[0][1], moves[0][2]
    result["reshard_bare"] = [t for t, _g, _s in bare]
    result["reshard_bare_received"], result["reshard_bare_sent"] = bare[0][1], bare[0][2]
    result["bandwidth"] = most / statistics.median(links)
    with open(os.path.join(os.environ["BENCH_OUT"], f"result.{me}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
