"""`make gpu-check`: the GPU path on a real GPU, in one prepared run of at most 5 minutes.

Rows (each prints PASS / FAIL / SKIP with what it measured):
  1. a CUDA model, 2 workers sharing one GPU over gloo, through a SIGKILL and a scale-up:
     bitwise-equal ranks and an exactly-once history;
  2. the same CUDA model through a driver SIGKILL and a rerun that resumes from the
     checkpoint: bitwise equal to an uninterrupted run;
  3. commit (device -> pinned host) and restore (pinned host -> device) bandwidth of CUDA
     state through elastic's Snapshot, against a plain ``copy_`` of the same bytes;
  4. a one-rank NCCL group: created eagerly, used, waited on by polling, aborted;
  5. with 2 or more GPUs: NCCL workers (one per GPU, over two loopback "hosts") through a
     SIGKILL; the survivors' next step must come within 2 s.
``--allow-cpu`` runs rows 1-3 on the CPU, to check this script where no GPU is lent.
Exit status: 0 when no row failed.
"""

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402
from support.jobs import Job, wait_unlocked  # noqa: E402

CKPT_WORKLOAD = REPO / "tests" / "workloads" / "ckpt_train.py"
ROWS = []


def row(name):
    def register(fn):
        ROWS.append((name, fn))
        return fn
    return register


class Skip(Exception):
    pass


def _env(device, backend):
    return {"JOB_DEVICE": device, "ELASTIC_BACKEND": backend}


@row("CUDA model, 2 workers share 1 GPU over gloo: SIGKILL + scale-up")
def shared_gpu_job(tmp, device):
    third = __import__("socket").gethostname()
    job = Job(tmp, ["-np", "2", "--min-np", "1", "--max-np", "2"],
              hosts=["localhost:1", "127.0.0.1:1"],
              env={**_env(device, "gloo"), "JOB_FAULT": "3:1:kill", "JOB_HOLD": "8"}).start()
    job.wait_step(8, size=1)
    job.set_hosts(["localhost:1", "127.0.0.1:1", f"{third}:1"])
    job.wait_step(9, size=2)     # the new round ends the hold
    finals = job.assert_ok(job.finish(), final_size=2)
    sizes = sorted({r["size"] for r in job.steps()})
    return f"sizes {sizes}, {finals[0]['step']} steps, ranks bitwise equal, exactly once"


@row("CUDA model: driver SIGKILL, rerun resumes bitwise")
def driver_kill_resume(tmp, device):
    def job(path, ckpt=None):
        args = ["-np", "2", "-H", "localhost:2"] + (["--checkpoint-dir", str(ckpt)] if ckpt else [])
        return Job(path, args, env={**_env(device, "gloo"), "JOB_STEP_SLEEP": "0.05"},
                   script=CKPT_WORKLOAD)
    base = job(tmp / "base")
    reference = base.assert_ok(base.run(), epochs=6, samples=64, final_size=2)[0]
    ckpt = tmp / "ckpt"
    first = job(tmp / "run1", ckpt).start()
    first.wait_for(lambda: any(ckpt.glob("ckpt-*.json")), "a checkpoint")
    os.kill(first.proc.pid, signal.SIGKILL)
    first.finish()
    wait_unlocked(ckpt)
    rerun = job(tmp / "run2", ckpt)
    finals = rerun.assert_ok(rerun.run(), epochs=6, samples=64, final_size=2)
    if finals[0]["params"] != reference["params"] or finals[0]["optimizer"] != reference["optimizer"]:
        raise AssertionError("the resumed run differs from the uninterrupted one")
    resumed = (finals[0].get("resumed_from") or {}).get("version")
    if not resumed:
        raise AssertionError("the rerun did not resume from a checkpoint")
    return f"resumed from commit {resumed}; bitwise equal to the uninterrupted run"


@row("commit / restore bandwidth of CUDA state vs plain copy_")
def bandwidth(_tmp, device):
    from elastic.state.snapshot import Snapshot
    dev = torch.device(device)
    numel = 64 << 20 if device == "cuda" else 16 << 20
    tensors = [torch.randn(numel // 8, device=dev) for _ in range(8)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pinned = device == "cuda"
    plain = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]

    def timed(fn, reps=3):
        fn()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9

    def plain_d2h():
        for h, t in zip(plain, tensors):
            h.copy_(t, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()

    def plain_h2d():
        for h, t in zip(plain, tensors):
            t.copy_(h, non_blocking=pinned)

    snap = Snapshot()
    tree = {"t": tensors}
    commit = timed(lambda: snap.save(tree))
    base_d2h = timed(plain_d2h)

    def restore():
        back = snap.materialize(shared=True)["t"]
        for t, h in zip(tensors, back):
            t.copy_(h, non_blocking=pinned)
    restore_bw, base_h2d = timed(restore), timed(plain_h2d)
    is_pinned = all(b.is_pinned() for b in snap.buffers) if pinned else None
    if pinned and not is_pinned:
        raise AssertionError("commit buffers are not pinned")
    return (f"{nbytes / 1e6:.0f} MB: commit {commit:.1f} GB/s vs copy_ {base_d2h:.1f} "
            f"({commit / base_d2h:.2f}x); restore {restore_bw:.1f} vs {base_h2d:.1f} GB/s "
            f"({restore_bw / base_h2d:.2f}x); pinned={is_pinned}")


@row("one-rank NCCL group: created eagerly, used, polled, aborted")
def nccl_one_rank(_tmp, device):
    from elastic.worker import nccl
    if device != "cuda":
        raise Skip("no CUDA device")
    if not nccl.available():
        raise AssertionError("torch sees CUDA but has no NCCL")
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta_s(30))
    t0 = time.perf_counter()
    group = nccl.new_group(dist.PrefixStore("check/", store), 0, 1, 0, 30.0)
    created = time.perf_counter() - t0
    x = torch.ones(1 << 20, device="cuda")
    work = group.allreduce([x])
    nccl.wait_polling(work, 0.01, 30, lambda: False, what="allreduce")
    torch.cuda.synchronize()
    if float(x[0]) != 1.0:
        raise AssertionError(f"allreduce gave {float(x[0])}")
    t1 = time.perf_counter()
    offered = nccl.abort(group)
    aborted = time.perf_counter() - t1
    return f"created in {created:.2f} s, allreduce ok, abort offered={offered} in {aborted:.2f} s"


def timedelta_s(s):
    from datetime import timedelta
    return timedelta(seconds=s)


@row("NCCL workers (1 per GPU) through a SIGKILL: survivors' next step within 2 s")
def nccl_kill(tmp, device):
    n = torch.cuda.device_count() if device == "cuda" else 0
    if n < 2:
        raise Skip(f"needs 2 or more GPUs, found {n}")
    workers = min(4, n)
    half = workers // 2
    hosts = f"localhost:{half},127.0.0.1:{workers - half}"
    visible = (f"localhost={','.join(map(str, range(half)))};"
               f"127.0.0.1={','.join(map(str, range(half, workers)))}")
    job = Job(tmp, ["-np", str(workers), "--min-np", str(half), "-H", hosts],
              env={**_env("cuda", "nccl"), "JOB_FAULT": f"5:{workers - 1}:kill",
                   "JOB_VISIBLE_DEVICES": visible, "JOB_EPOCHS": "4"})
    job.assert_ok(job.run(), epochs=4, final_size=half)
    killed_at = (job.out / "fault.0").stat().st_mtime
    after = [r["t"] for r in job.steps() if r["t"] > killed_at and r["size"] == half]
    if not after:
        raise AssertionError("no step after the kill")
    gap = min(after) - killed_at
    if gap > 2.0:
        raise AssertionError(f"survivors' next step came {gap:.2f} s after the kill")
    return f"{workers} NCCL workers -> {half}; next step {gap:.2f} s after the SIGKILL"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run the rows that can run without a GPU on the CPU")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        device = "cuda"
    elif args.allow_cpu:
        device = "cpu"
    else:
        sys.stderr.write("gpu_check: error: no CUDA device here (use --allow-cpu to check the "
                         "script itself on the CPU)\n")
        return 2
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (--allow-cpu)"
    print(f"gpu-check on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    results, failed = [], False
    for title, fn in ROWS:
        tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        t0 = time.monotonic()
        try:
            status, detail = "PASS", fn(tmp, device)
        except Skip as why:
            status, detail = "SKIP", str(why)
        except Exception as exc:  # noqa: BLE001 - every row reports, the run goes on
            status, detail, failed = "FAIL", f"{type(exc).__name__}: {str(exc)[-600:]}", True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        results.append((title, status, time.monotonic() - t0, detail))
        print(f"  {status}  {title} ({results[-1][2]:.0f} s): {detail}", flush=True)
    print("\n| check | result | time | measured |\n|---|---|---|---|")
    for title, status, secs, detail in results:
        print(f"| {title} | {status} | {secs:.0f} s | {detail.splitlines()[0] if detail else ''} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
