"""FSDP2 steady-state row of `make bench` (alone: `BENCH_ONLY=fsdpsteady make bench`).

The same FSDP2 script (fsdp_steady_worker.py) under elasticrun (elastic.ShardedState,
a commit with one redundancy copy every 10 steps) and under torchrun (the plain FSDP2
loop, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 as DESIGN's hazard says), 2 workers,
interleaved repeats; throughput ratio elastic / torchrun (target >= 0.95x).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import BENCH, REPO  # noqa: E402

WORKER = BENCH / "fsdp_steady_worker.py"
DEADLINE_S = 300


def run_once(launcher, args, env):
    """Median step seconds of one run of the worker under ``launcher()``."""
    out = Path(tempfile.mkdtemp(prefix="bench-fsdp-"))
    full_env = common.base_env()
    full_env.update(env, BENCH_OUT=str(out))
    for _try in range(2):         # torchrun's --master-port may have been taken meanwhile
        proc = subprocess.run(launcher() + args, env=full_env, cwd=str(REPO),
                              capture_output=True, text=True, timeout=DEADLINE_S)
        if proc.returncode == 0:
            break
    if proc.returncode != 0:
        raise RuntimeError(f"fsdp steady run failed: {(proc.stdout + proc.stderr)[-800:]}")
    return statistics.median(json.loads((out / "steady.json").read_text())["step_s"])


def rows(quick=False):
    """[(metric, elastic, baseline, ratio, target, met)] and notes."""
    args = ["steps=60", "commit_every=10", "warmup=10"]
    e_runs, t_runs = [], []
    for _ in range(2 if quick else 3):
        e_runs.append(run_once(
            lambda: [sys.executable, "-m", "elastic.runner", "-np", "2", "-H", "localhost:2",
                     sys.executable, str(WORKER)], args, {}))
        t_runs.append(run_once(
            lambda: [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "--master-port", str(common.free_port()), str(WORKER)], args,
            {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}))
    e, t = statistics.median(e_runs), statistics.median(t_runs)
    ratio = t / e
    out = [("FSDP2 steady state (4 × Linear(512, 512) + AdamW, 2 workers, batch 32): "
            "throughput with elastic.ShardedState under elasticrun (a commit with one "
            "redundancy copy every 10 steps) vs the plain FSDP2 script under torchrun",
            f"{1 / e:.1f} steps/s", f"{1 / t:.1f} steps/s", f"{ratio:.2f}×", "≥ 0.95×",
            "yes" if ratio >= 0.95 else "**no**")]
    notes = [f"fsdp steady: per-run median step time, elasticrun "
             f"{[round(x * 1e3, 1) for x in e_runs]} ms, torchrun "
             f"{[round(x * 1e3, 1) for x in t_runs]} ms (interleaved runs)"]
    return out, notes


if __name__ == "__main__":
    got, notes = rows(quick=os.environ.get("BENCH_QUICK") == "1")
    common.print_rows(got, notes)
