"""Bytes written per sharded checkpoint in a real FSDP2 job (`BENCH_ONLY=fsdpckpt`).

Two elasticrun jobs of fsdp_ckpt_worker.py (2 workers, 4 x Linear(1024, 1024) sharded
with fully_shard, AdamW, a commit and its durable checkpoint every 4 steps, in
elasticrun's --checkpoint-dir): one with the first half of the layers frozen
(requires_grad False: their shards and optimizer state never change), one where
everything trains (every row changes: each checkpoint is a full write). The bytes
are what landed in the checkpoint directory per commit after the first (new blob
files and the manifests), counted by rank 0 once every rank's manifest is there.
Expected ratio: the changing fraction of the full state, the trained layers' share
(parameters and AdamW's two moments alike).
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

WORKER = BENCH / "fsdp_ckpt_worker.py"
DEADLINE_S = 300


def run_job(frozen, steps):
    """The worker's ckpt.json of one elasticrun job (2 workers, localhost)."""
    with tempfile.TemporaryDirectory(prefix="bench-fsdpckpt-") as tmp:
        out, ckpt = Path(tmp) / "out", Path(tmp) / "ckpt"
        out.mkdir()
        env = common.base_env()
        env["BENCH_OUT"] = str(out)
        proc = subprocess.run(
            [sys.executable, "-m", "elastic.runner", "-np", "2", "-H", "localhost:2",
             "--checkpoint-dir", str(ckpt), sys.executable, str(WORKER), f"steps={steps}",
             "commit_every=4", f"frozen={frozen}"],
            env=env, cwd=str(REPO), capture_output=True, text=True, timeout=DEADLINE_S)
        if proc.returncode != 0:
            raise RuntimeError(f"fsdp checkpoint job failed: {(proc.stdout + proc.stderr)[-800:]}")
        return json.loads((out / "ckpt.json").read_text())


def per_commit(job):
    """[(MB landed, MB the commit's manifests name)] of each commit of a job."""
    return [(round(c["written"] / 1e6, 2), round(c["total"] / 1e6, 2)) for c in job["commits"]]


def rows(quick=False):
    """[(metric, elastic, baseline, ratio, target, met)] and notes."""
    steps = 16 if quick else 28          # 4 or 7 checkpoints, the first one all-new
    half, full = run_job(2, steps), run_job(0, steps)
    load = os.getloadavg()
    h = statistics.median(c["written"] for c in half["commits"][1:])
    f = statistics.median(c["written"] for c in full["commits"][1:])
    expect = half["trainable_bytes"] / half["params_bytes"]
    ratio = h / f
    out = [(f"sharded checkpoint (ShardedState, FSDP2 4 × Linear(1024, 1024) + AdamW, "
            f"elasticrun, 2 workers, a commit + checkpoint every 4 steps): bytes landed in the "
            f"checkpoint dir per checkpoint after the first, {half['frozen']} of "
            f"{half['depth']} layers frozen vs everything training (a full write)",
            f"{h / 1e6:.1f} MB", f"{f / 1e6:.1f} MB", f"{ratio:.2f}×",
            f"≈ {expect:.2f}× (the changing fraction)",
            "yes" if abs(ratio - expect) <= 0.05 else "**no**")]
    notes = [f"fsdp checkpoint bytes per commit (MB landed / MB the commit's manifests name), "
             f"frozen {per_commit(half)}, all training {per_commit(full)}"
             f"; the frozen job's own whole checkpoint is {half['commits'][-1]['total'] / 1e6:.1f} "
             f"MB (frozen weights, no AdamW state for them), so its incremental checkpoint "
             f"writes {h / half['commits'][-1]['total']:.2f}× of itself; what is left besides "
             "the trained rows: each shard's pack of small tensors (biases, AdamW steps), "
             f"the replicated rest and the manifests; load average {load[0]:.1f} (1 min) at the "
             "end"]
    return out, notes


if __name__ == "__main__":
    got, notes = rows(quick=os.environ.get("BENCH_QUICK") == "1")
    common.print_rows(got, notes)
