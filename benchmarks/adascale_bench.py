"""The cost of LRScaler(rule="adascale") against the linear rule, on 2 gloo workers.

Three copies of a model, each with its own DistributedOptimizer: one with the linear
rule, one with adascale (two squared norms per bucket and one scalar allreduce per
step), one with adascale measuring every 8th step. Steps rotate between them, so
load spikes hit all sides alike. The CPU time of the training thread inside
adascale's observer is also measured per step, against the thread's CPU time for
the whole step: time the process is descheduled (this machine is shared) counts in
neither. Writes $BENCH_OUT/result.<rank>.json: per model kind,
each side's per-step seconds (wall, and the thread's CPU) and the observer's CPU.
Usage: adascale_bench.py REPS [KIND:KIND...] (kinds: mlp, cnn).
"""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import elastic  # noqa: E402


def side(build, rule, batches, every=1):
    torch.manual_seed(0)
    model = build()
    opt = elastic.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01,
                                                       momentum=0.9),
                                       named_parameters=model.named_parameters())
    scaler = elastic.LRScaler(opt, base_size=1, rule=rule, measure_every=every)
    spent = []          # seconds inside the adascale observer, per step
    observer = opt.gradient_observer
    if observer is not None:
        def timed(fn):
            def call(*args):
                t0 = time.thread_time()
                fn(*args)
                spent[-1] += time.thread_time() - t0
            return call
        observer.local, observer.reduced = timed(observer.local), timed(observer.reduced)

    def step(i):
        x, y = batches[i % len(batches)]
        spent.append(0.0)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step, scaler, common.n_params(model), spent


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    kinds = (sys.argv[2] if len(sys.argv) > 2 else "mlp:cnn").split(":")
    elastic.init()
    out = {}
    for kind, build in (("mlp", common.mlp_10m), ("cnn", common.small_cnn)):
        if kind not in kinds:
            continue
        batches = [common.batch_for(kind, 16, 1000 * elastic.rank() + i) for i in range(4)]
        linear, _, params, _ = side(build, "linear", batches)
        ada, scaler, _, spent = side(build, "adascale", batches)
        ada8, _, _, spent8 = side(build, "adascale", batches, every=8)
        sides = [linear, ada, ada8]
        for i in range(4):                  # warm-up: buckets, gloo connections, allocator
            for run in sides:
                run(i)
        times, cpu = [[], [], []], [[], [], []]
        for i in range(reps):
            order = [(j + i) % 3 for j in range(3)]     # who goes first rotates
            for j in order:
                t0, c0 = time.perf_counter(), time.thread_time()
                sides[j](i)
                times[j].append(time.perf_counter() - t0)
                cpu[j].append(time.thread_time() - c0)
        out[kind] = {"linear": times[0], "adascale": times[1], "adascale8": times[2],
                     "cpu": cpu[0], "cpu_adascale": cpu[1], "cpu_adascale8": cpu[2],
                     "observer": spent[-reps:], "observer8": spent8[-reps:], "params": params,
                     "gain": scaler.gain, "observations": scaler.estimator.observations}
    with open(os.path.join(os.environ["BENCH_OUT"], f"result.{elastic.rank()}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
