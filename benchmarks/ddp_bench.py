"""DDP rows of `make bench` (alone: `BENCH_ONLY=ddp make bench`, or run this file).

1. Steady state: the same DDP script (ddp_worker.py, elastic.DDP) under elasticrun and
   under torchrun (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, DESIGN's hazard), 2 workers,
   pairs of runs back to back, which side goes first alternating; throughput ratio
   elastic / torchrun = median of the pairs' ratios, with their range (target >= 0.97x).
   BENCH_DDP_REPS sets the pairs (6; 2 quick); BENCH_DDP_PAUSE=0 skips row 2.
2. The pause of a change: survivors' gap between their steps around a scale-up 2 -> 3,
   for the DDP script and for the same script on DistributedOptimizer.
"""

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import BENCH, REPO  # noqa: E402

WORKER = BENCH / "ddp_worker.py"
DEADLINE_S = 300


def _records(out):
    return common.read_jsonl(out, "steps.*.jsonl")


def _run(launcher, args, env):
    out = Path(tempfile.mkdtemp(prefix="bench-ddp-"))
    full_env = common.base_env()
    full_env.update(env, BENCH_OUT=str(out))
    for _try in range(2):         # torchrun's --master-port may have been taken meanwhile
        proc = subprocess.run(launcher() + args, env=full_env,
                              cwd=str(REPO), capture_output=True, text=True, timeout=DEADLINE_S)
        if proc.returncode == 0:
            break
    if proc.returncode != 0:
        raise RuntimeError(f"{launcher()[2]} failed: {(proc.stdout + proc.stderr)[-800:]}")
    return json.loads((out / "steady.json").read_text())["step_s"]


def steady(reps=3, steps=80):
    """(elastic step times, torchrun step times), each a list of per-run medians; run i
    of one side and run i of the other ran back to back (a pair), which goes first
    alternating, so the machine's load weighs on both sides of a pair alike."""
    args = ["mode=ddp", f"steps={steps}", "commit_every=10", "warmup=10"]
    sides = {
        "elastic": (lambda: [sys.executable, "-m", "elastic.runner", "-np", "2",
                             "-H", "localhost:2", sys.executable, str(WORKER)], {}),
        "torchrun": (lambda: [sys.executable, "-m", "torch.distributed.run",
                              "--nproc-per-node", "2", "--master-port",
                              str(common.free_port()), str(WORKER)],
                     {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
    }
    runs = {name: [] for name in sides}
    for rep in range(reps):
        for name in (("elastic", "torchrun") if rep % 2 == 0 else ("torchrun", "elastic")):
            launcher, env = sides[name]
            runs[name].append(statistics.median(_run(launcher, args, env)))
    return runs["elastic"], runs["torchrun"]


def change_pause(mode):
    """Survivors' gap (s) between their last step of the first round and their first of
    the round that admits a third worker, for ``mode`` ddp or dopt."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-ddp-pause-"))
    out, hosts, hold = tmp / "out", tmp / "hosts.txt", tmp / "stop"
    out.mkdir()
    hosts.write_text("localhost:2\n")
    discover = tmp / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    env = common.base_env()
    env.update(BENCH_OUT=str(out), BENCH_STEP_SLEEP="0.01", BENCH_HOLD_FILE=str(hold))
    log = open(tmp / "elasticrun.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastic.runner", "-np", "2", "--min-np", "2",
         "--host-discovery-script", str(discover), "--discovery-interval", "0.3",
         sys.executable, str(WORKER), f"mode={mode}", "steps=30", "commit_every=1"],
        env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: any(r["step"] >= 30 for r in _records(out)), proc)
        tmp_hosts = hosts.with_suffix(".tmp")
        tmp_hosts.write_text("localhost:2\n127.0.0.1:1\n")
        tmp_hosts.rename(hosts)
        _wait(lambda: len([r for r in _records(out) if r["size"] == 3]) >= 3 * 20, proc)
        hold.write_text("stop")
        if proc.wait(DEADLINE_S) != 0:
            raise RuntimeError(f"{mode} job failed")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    steps = _records(out)
    first = min(r["round"] for r in steps)
    grown = min(r["round"] for r in steps if r["size"] == 3)
    gaps = []
    for rank in (0, 1):
        before = max(r["t"] for r in steps if r["round"] == first and r["rank"] == rank)
        after = min(r["t"] for r in steps if r["round"] == grown and r["rank"] == rank)
        gaps.append(after - before)
    return max(gaps)


def _wait(predicate, proc):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise RuntimeError("the job ended early")
        time.sleep(0.1)
    raise RuntimeError("timed out")


def rows(quick=False, pause=True):
    """[(metric, elastic, baseline, ratio, target, met)] and notes."""
    reps = int(os.environ.get("BENCH_DDP_REPS", 2 if quick else 6))
    e_runs, t_runs = steady(reps)
    e, t = statistics.median(e_runs), statistics.median(t_runs)
    pairs = [ti / ei for ei, ti in zip(e_runs, t_runs)]       # throughput ratio per pair
    ratio = statistics.median(pairs)
    out = [("DDP steady state (elastic.DDP, 1.3M-param MLP, 2 workers, batch 32, commit every "
            "10 steps): throughput under elasticrun vs the same script under torchrun",
            f"{1 / e:.1f} steps/s", f"{1 / t:.1f} steps/s",
            f"{ratio:.2f}× (pairs {min(pairs):.2f}–{max(pairs):.2f})", "≥ 0.97×",
            "yes" if min(pairs) >= 0.97 else
            ("within noise: the pairs straddle 0.97×" if max(pairs) >= 0.97 else "**no**"))]
    notes = [f"ddp steady: {reps} pairs of runs back to back (which goes first alternates); "
             f"per-run median step time, elasticrun {[round(x * 1e3, 1) for x in e_runs]} ms, "
             f"torchrun {[round(x * 1e3, 1) for x in t_runs]} ms; ratio = median of the "
             f"pairs' ratios {[round(p, 2) for p in pairs]}"]
    if pause:
        ddp_pause, dopt_pause = change_pause("ddp"), change_pause("dopt")
        out.append(("scale-up 2→3: survivors' pause, DDP job (elastic.DDP) vs the same job on "
                    "DistributedOptimizer", f"{ddp_pause:.2f} s", f"{dopt_pause:.2f} s",
                    f"{ddp_pause / dopt_pause:.2f}×", "—", "—"))
    return out, notes


if __name__ == "__main__":
    got, notes = rows(quick=os.environ.get("BENCH_QUICK") == "1",
                      pause=os.environ.get("BENCH_DDP_PAUSE", "1") == "1")
    common.print_rows(got, notes)
