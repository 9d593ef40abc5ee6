"""Durable checkpoints, standalone (size 1): write throughput vs dd, training stall, bytes.

    ckpt_bench.py DIR [REPS]

DIR is an empty directory on the disk to measure (the caller removes it). Model:
an MLP of 8.4M parameters (1024 -> 4096 -> 1024 -> 10) with Adam, about 101 MB
of state; its first layer is exactly half the parameters, which is what the
"half frozen" variant freezes.

  write     a checkpoint written by Checkpointer's own writer thread, every
            tensor changed since the previous one (a training step between), timed
            from the end of the commit that hands it over to Checkpointer.wait()
            (hash, write, fsync, rename, manifest, prune), the training thread idle;
            interleaved with `dd if=/dev/zero of=DIR/ddfile bs=4M count=N
            conv=fsync` of as many bytes (N rounded), alternating which goes first
  stall     commit() with a checkpoint due (writer idle) vs commit() of a state
            without a checkpointer, back to back in each repeat, alternating order;
            (wall time, and the training thread's own CPU time); the hand-off and the
            next commit's spare-buffer swap are also timed inside the Checkpointer
            (instance-level wrappers)
  bytes     bytes_written per checkpoint after the first: half the parameters
            frozen (not in the optimizer) vs nothing frozen
Writes $BENCH_OUT/result.0.json.
"""

import gc
import os
import re
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import elastic  # noqa: E402

now = time.perf_counter
MiB4 = 4 << 20
WARM = int(os.environ.get("BENCH_CKPT_WARM", "2"))


def build(freeze_half=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10))
    if freeze_half:
        for p in model[0].parameters():
            p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x, y = common.batch_for("mlp", 16, 0)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    step()
    return model, opt, step


def timed(fn):
    t0 = now()
    fn()
    return now() - t0


def dd(directory, count):
    """dd's own elapsed time (its report), and the wall time around the process."""
    env = dict(os.environ, LC_ALL="C", LANG="C")
    t0 = now()
    p = subprocess.run(["dd", "if=/dev/zero", f"of={os.path.join(directory, 'ddfile')}",
                        "bs=4M", f"count={count}", "conv=fsync"], env=env, check=True,
                       capture_output=True, text=True)
    wall = now() - t0
    m = re.search(r"copied, ([0-9.eE+-]+) s", p.stderr)
    return (float(m.group(1)) if m else wall), wall


def state_bytes(state):
    return sum(b.numel() * b.element_size() for b in state.snapshot.buffers)


def main():
    root = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    os.makedirs(root, exist_ok=True)
    elastic.init()
    assert elastic.size() == 1 and elastic.worker.runtime.worker() is None
    model, opt, step = build()
    plain = elastic.TorchState(model, opt, elastic_checkpoint=False, n=0)
    plain.sync()
    ck = elastic.Checkpointer(os.path.join(root, "full"), every_commits=1, keep=2)
    state = elastic.TorchState(model, opt, elastic_checkpoint=ck, n=0)
    state.sync()                                # takes the directory lock (rank 0 of size 1)

    handoff, swap = [], []
    real_committed, real_before = ck.committed, ck.before_save

    def committed(version, snapshot):
        busy = ck.writing
        t0 = now()
        real_committed(version, snapshot)
        if ck.writing and not busy:
            handoff.append(now() - t0)

    def before_save(snapshot):
        swapped = ck.stats["swapped_commits"]
        t0 = now()
        real_before(snapshot)
        if ck.stats["swapped_commits"] > swapped:
            swap.append(now() - t0)

    ck.committed, ck.before_save = committed, before_save

    # Warm-up: both snapshots allocated, a first (all-new) checkpoint on disk, then WARM
    # checkpoint + dd pairs: on this VM the first writes after a start stall 200-300 ms
    # now and then, dd's as well as ours (their times are in the result, unused).
    step()
    plain.commit()
    state.commit()
    ck.wait()
    first = ck.stats["last"]
    warm = []
    for _ in range(WARM):
        step()
        state.commit()
        t0 = now()
        ck.wait()
        warm.append((now() - t0, dd(root, max(1, round(first["bytes_written"] / MiB4)))[0]))

    # -- write throughput vs dd, interleaved ----------------------------------------------
    write_s, write_bytes, write_inner_s, write_release_s, prune_s = [], [], [], [], []
    dd_s, dd_wall_s, dd_bytes = [], [], []
    for rep in range(reps):
        def ckpt():
            step()                               # every tensor changes: all bytes are new
            gc.collect()
            state.commit()
            t0 = now()
            ck.wait()
            write_s.append(now() - t0)
            write_bytes.append(ck.stats["last"]["bytes_written"])
            write_inner_s.append(ck.stats["last"]["seconds"])
            write_release_s.append(ck.stats["last"]["release_s"])
            prune_s.append(ck.stats["last"]["prune_s"])

        def base():
            count = max(1, round((write_bytes[-1] if write_bytes else first["bytes_written"])
                                 / MiB4))
            gc.collect()
            own, wall = dd(root, count)
            dd_s.append(own)
            dd_wall_s.append(wall)
            dd_bytes.append(count * MiB4)
        for fn in ((ckpt, base) if rep % 2 == 0 else (base, ckpt)):
            fn()
    os.unlink(os.path.join(root, "ddfile"))

    # -- stall: a commit with a checkpoint due vs a commit without a checkpointer --------
    due_s, plain_s, next_s, step_s, step_write_s = [], [], [], [], []
    due_cpu, plain_cpu = [], []            # the training thread's own CPU time
    handoff.clear()
    swap.clear()
    for rep in range(2 * reps - 1):
        sides = [("plain", plain.commit), ("due", state.commit)]
        for name, fn in (sides if rep % 2 == 0 else sides[::-1]):
            ck.wait()                            # neither side competes with a write
            step_s.append(timed(step))
            gc.collect()
            c0 = time.thread_time()
            t = timed(fn)
            (due_cpu if name == "due" else plain_cpu).append(time.thread_time() - c0)
            (due_s if name == "due" else plain_s).append(t)
            if name == "due":
                busy = ck.writing
                step_write_s.append(timed(step) if busy else None)     # the writer runs
                next_s.append(timed(state.commit) if ck.writing else None)
    ck.wait()
    swapped = ck.stats["swapped_commits"]
    deferred = ck.stats["deferred"]
    full_total = ck.stats["last"]["bytes_total"]
    ck.close(final=False)
    # What the writer's hashing alone costs on this CPU: its content hash (xxh3-128) of the
    # same buffers, and sha256 (format 1's) for comparison.
    from elastic.checkpoint.format import content_name, sha256_hex
    from elastic.checkpoint.writer import byte_view
    hash_s = [timed(lambda: [content_name(byte_view(b)) for b in state.snapshot.buffers])
              for _ in range(3)]
    sha_s = [timed(lambda: [sha256_hex(byte_view(b)) for b in state.snapshot.buffers])
             for _ in range(3)]

    # -- bytes: half the parameters frozen --------------------------------------------------
    h_model, h_opt, h_step = build(freeze_half=True)
    ck2 = elastic.Checkpointer(os.path.join(root, "half"), every_commits=1, keep=2)
    half = elastic.TorchState(h_model, h_opt, elastic_checkpoint=ck2, n=0)
    half.sync()
    half_written = []
    for _ in range(4):
        h_step()
        half.commit()
        ck2.wait()
        half_written.append(ck2.stats["last"]["bytes_written"])
    half_total = ck2.stats["last"]["bytes_total"]
    frozen = sum(p.numel() * p.element_size() for p in h_model.parameters()
                 if not p.requires_grad)
    trainable = sum(p.numel() * p.element_size() for p in h_model.parameters()
                    if p.requires_grad)
    ck2.close(final=False)

    common.write_json(os.path.join(os.environ["BENCH_OUT"], "result.0.json"), {
        "params": common.n_params(model), "state_bytes": state_bytes(state),
        "first": {k: first[k] for k in ("bytes_written", "bytes_total", "seconds")},
        "warm": warm, "write_s": write_s, "write_bytes": write_bytes, "write_inner_s": write_inner_s,
        "write_release_s": write_release_s, "prune_s": prune_s,
        "dd_s": dd_s, "dd_wall_s": dd_wall_s, "dd_bytes": dd_bytes,
        "due_s": due_s, "plain_s": plain_s, "due_cpu": due_cpu, "plain_cpu": plain_cpu,
        "next_s": next_s, "step_s": step_s,
        "step_write_s": step_write_s, "handoff_s": handoff, "swap_s": swap,
        "hash_s": hash_s, "sha_s": sha_s, "swapped_commits": swapped, "deferred": deferred,
        "full_total": full_total,
        "half_written": half_written, "half_total": half_total, "frozen_bytes": frozen,
        "trainable_param_bytes": trainable, "st_dev": os.stat(root).st_dev,
    })


if __name__ == "__main__":
    main()
