"""Measure checkpoint costs standalone (size 1): stall, write throughput, bytes, load time.

    python tests/workloads/ckpt_measure.py [DIR]      (DIR: on the disk to measure; default a temp dir)

Model: an MLP of about 9.5M parameters with Adam (params + exp_avg + exp_avg_sq,
about 114 MB). Prints one JSON object:
  commit_ms          state.commit() without a checkpointer (median)
  handoff_ms         what the commit that starts a checkpoint spends handing it over
  swap_ms            what the next commit spends taking spare buffers when the writer is
                     still reading (the training thread never waits for the writer)
  next_commit_ms     that whole next commit, while the writer competes for memory and CPU
  loop_ms_*          step + commit in a loop, without / with a checkpoint at every commit
  step_ms / step_during_write_ms   a training step alone / while a write runs
  write_gbs / dd_gbs  a full checkpoint alone (hash, write, fsync, rename, manifest) vs
                     dd bs=4M conv=fsync of as many bytes to the same directory
  bytes_full / bytes_incremental_half_frozen   bytes written per checkpoint after the first
  load_ms            load_newest (read + verify) + apply, the load part of a recovery
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import elastic
from elastic import checkpoint_store as store
from elastic.checkpoint_write import write_checkpoint

now = time.perf_counter


def build(freeze_half=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10))
    if freeze_half:
        for p in model[0].parameters():
            p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x, y = torch.randn(16, 1024), torch.randint(0, 10, (16,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    step()
    return model, opt, step


def timed(fn):
    t0 = now()
    fn()
    return now() - t0


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ckpt-measure-")
    os.makedirs(root, exist_ok=True)
    reps = 9
    model, opt, step = build()
    plain = elastic.TorchState(model, opt, checkpoint=False, n=0)
    plain.sync()
    commit_s = []
    step_s = []
    for _ in range(reps):
        step_s.append(timed(step))
        commit_s.append(timed(plain.commit))
    commit = statistics.median(commit_s)

    ck = elastic.Checkpointer(os.path.join(root, "full"), every_commits=2, keep=2)
    state = elastic.TorchState(model, opt, checkpoint=ck, n=0)
    state.sync()
    state.commit()
    handoff, swap = [], []
    real_after, real_before = ck.after_commit, ck.before_save

    def after_commit(st):
        t0 = now()
        real_after(st)
        if ck._busy:
            handoff.append(now() - t0)

    def before_save(st):
        t0 = now()
        swapped = ck.stats["swapped_commits"]
        real_before(st)
        if ck.stats["swapped_commits"] > swapped:
            swap.append(now() - t0)

    ck.after_commit, ck.before_save = after_commit, before_save
    during, after, written = [], [], []
    for i in range(reps):
        step()
        state.commit()                          # due: hands this commit to the writer
        during.append(timed(step))              # a step while the write runs
        after.append(timed(state.commit))       # the next commit, the write maybe still running
        ck.wait()
        written.append(ck.stats["last"]["bytes_written"])
    full_bytes = ck.stats["last"]["bytes_total"]
    swapped = ck.stats["swapped_commits"]
    # Steady training: a checkpoint at every commit vs none (includes CPU contention).
    ck.every_commits = 1
    loops = {}
    for name, st in (("plain", plain), ("checkpointing", state)):
        t0 = now()
        for _ in range(reps * 2):
            step()
            st.commit()
        loops[name] = (now() - t0) / (reps * 2)
    ck.close(final=False)

    # Write throughput alone (fresh directory, all bytes new) vs dd of as many bytes.
    snap = state._snapshot
    write_gbs, dd_gbs = [], []
    for rep in range(3):
        target = os.path.join(root, f"alone{rep}")
        t0 = now()
        result = write_checkpoint(target, 1, snap.skeleton, snap.buffers)
        write_gbs.append(result["bytes_written"] / (now() - t0) / 1e9)
        dd_path = os.path.join(root, "dd.bin")
        count = max(1, result["bytes_written"] // (4 << 20))
        t0 = now()
        subprocess.run(["dd", "if=/dev/zero", f"of={dd_path}", "bs=4M", f"count={count}",
                        "conv=fsync"], check=True, capture_output=True)
        dd_gbs.append(count * (4 << 20) / (now() - t0) / 1e9)
        os.unlink(dd_path)

    half_model, half_opt, half_step = build(freeze_half=True)
    ck2 = elastic.Checkpointer(os.path.join(root, "half"), every_commits=1, keep=2)
    half = elastic.TorchState(half_model, half_opt, checkpoint=ck2, n=0)
    half.sync()
    half_written = []
    for _ in range(3):
        half_step()
        half.commit()
        ck2.wait()
        half_written.append(ck2.stats["last"]["bytes_written"])
    ck2.close(final=False)

    fresh_model, fresh_opt, _ = build()
    loader = elastic.TorchState(fresh_model, fresh_opt, checkpoint=False, n=0)
    load_s = []
    for _ in range(3):
        t0 = now()
        _v, tree, _p = store.load_newest(os.path.join(root, "full"))
        loader.apply(tree)
        load_s.append(now() - t0)

    ms = lambda xs: round(statistics.median(xs) * 1e3, 3) if xs else None  # noqa: E731
    print(json.dumps({
        "state_mb": round(full_bytes / 1e6, 1), "commit_ms": ms(commit_s),
        "handoff_ms": ms(handoff), "swap_ms": ms(swap),
        "stall_pct_of_commit": round(100 * (statistics.median(handoff) + (
            statistics.median(swap) if swap else 0)) / commit, 2),
        "next_commit_ms": ms(after), "swapped_commits": swapped,
        "step_ms": ms(step_s), "step_during_write_ms": ms(during),
        "loop_ms_plain": ms([loops["plain"]]),
        "loop_ms_checkpoint_every_commit": ms([loops["checkpointing"]]),
        "write_gbs": round(statistics.median(write_gbs), 2),
        "dd_gbs": round(statistics.median(dd_gbs), 2),
        "write_vs_dd": round(statistics.median(write_gbs) / statistics.median(dd_gbs), 2),
        "bytes_first": written[0], "bytes_full": statistics.median(written[1:]),
        "bytes_incremental_half_frozen": statistics.median(half_written[1:]),
        "half_frozen_ratio": round(statistics.median(half_written[1:])
                                   / statistics.median(written[1:]), 3),
        "load_ms": ms(load_s),
    }))


if __name__ == "__main__":
    main()
