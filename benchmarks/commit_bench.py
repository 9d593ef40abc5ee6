"""state.commit() standalone (size 1) vs the same bytes copied two other ways.

Model: the ~10M-parameter MLP with Adam state (params + exp_avg + exp_avg_sq).
  elastic   TorchState.commit(): copy into preallocated host buffers
  copy_     a plain copy_ of every state tensor into preallocated buffers
  deepcopy  Horovod's way: copy.deepcopy(model.state_dict()) and of
            optimizer.state_dict(), replacing the previous copy once made
Repeats are interleaved; writes $BENCH_OUT/result.0.json.
"""

import copy
import gc
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import elastic  # noqa: E402

now = time.perf_counter


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    between_steps = len(sys.argv) > 2 and sys.argv[2] == "steps"
    elastic.init()
    assert elastic.size() == 1 and elastic.worker.runtime.worker() is None
    torch.manual_seed(0)
    model = common.mlp_10m()
    optimizer = elastic.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                             named_parameters=model.named_parameters())
    x, y = common.batch_for("mlp", 16, 0)

    def train_step():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    train_step()
    state = elastic.TorchState(model, optimizer, epoch=0, batch=0)

    tensors = list(model.state_dict().values()) + [
        v for s in optimizer.state_dict()["state"].values() for v in s.values()
        if torch.is_tensor(v)]
    buffers = [torch.empty_like(t) for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def plain_copy():
        with torch.no_grad():
            for b, t in zip(buffers, tensors):
                b.copy_(t)

    saved = [None, None]

    def deep():  # as Horovod's TorchState.save: each copy replaces the previous one
        saved[0] = copy.deepcopy(model.state_dict())
        saved[1] = copy.deepcopy(optimizer.state_dict())

    sides = {"elastic": state.commit, "copy_": plain_copy, "deepcopy": deep}
    first = {}
    for name, fn in sides.items():  # first commit allocates its buffers; copies touch theirs
        t0 = now()
        fn()
        first[name] = now() - t0
    times = {k: [] for k in sides}
    for rep in range(reps):
        names = list(sides) if rep % 2 == 0 else list(reversed(list(sides)))
        for name in names:
            if between_steps:
                train_step()  # commits happen between training steps, with their allocations
            gc.collect()
            t0 = now()
            sides[name]()
            times[name].append(now() - t0)
    snap = state.snapshot.nbytes()
    saved[:] = [None, None]
    restore_s = []
    for _ in range(3):  # what a survivor pays after a failure, before it rejoins
        gc.collect()
        t0 = now()
        state.restore()
        restore_s.append(now() - t0)
    # sync's pack() cost against the number of tensors (same bytes in total)
    from elastic.state.snapshot import pack
    pack_s = {}
    for n in (250, 1000, 4000):
        tree = {"t": [torch.zeros(4000 // n * 100) for _ in range(n)]}
        t0 = now()
        pack(tree)
        pack_s[n] = now() - t0
    common.write_json(os.path.join(os.environ["BENCH_OUT"], "result.0.json"),
                      {"bytes": nbytes, "snapshot_bytes": snap, "times": times, "first": first,
                       "restore_s": restore_s, "pack_s": pack_s})


if __name__ == "__main__":
    main()
