"""The cost of elastic.torch's pre-op check: hvd.allreduce vs the unchecked elastic.allreduce.

Both run on the same 2-worker gloo group, alternating call by call; writes
$BENCH_OUT/result.<rank>.json with per-op seconds for each side.
"""

import json
import os
import sys
import time

import torch

import elastic
import elastic.torch as hvd


def paired(a, b, iters):
    """Call a and b alternately; returns each one's per-call seconds (lists, in call order)."""
    a(), b()                               # warm
    ta, tb = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        ta.append(t1 - t0)
        tb.append(time.perf_counter() - t1)
    return ta, tb


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    hvd.init()
    out = {}
    for label, numel, iters in (("4 KB", 1024, 100 * reps), ("4 MB", 1 << 20, 5 * reps)):
        t = torch.ones(numel)
        checked, plain = paired(lambda t=t: hvd.allreduce(t), lambda t=t: elastic.allreduce(t),
                                iters)
        out[label] = {"checked": checked, "plain": plain}
    small = [torch.ones(256) for _ in range(50)]
    grouped, loose = paired(lambda: hvd.grouped_allreduce(small),
                            lambda: [hvd.allreduce(x) for x in small], 3 * reps)
    out["grouped"] = {"grouped": grouped, "loose": loose}
    with open(os.path.join(os.environ["BENCH_OUT"], f"result.{hvd.rank()}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
