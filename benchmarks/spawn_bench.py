"""A newcomer's set-up beside training, a row of `make bench` (`BENCH_ONLY=spawn`).

Three training processes (a matmul burst, then 20 ms asleep, as the churn job's steps)
share this machine's cores with a newcomer that imports what a replacement imports
(torch, torch._dynamo), one import after another. Phases of PHASE_S rotate through: no
newcomer, a newcomer at normal priority, and one started as the driver starts a warm
spare (runner/priority.py: ``chrt --idle 0``). The row is the training steps' slowdown
over the quiet phases, idle against normal: what idle priority leaves of an import's
cost, which is why the spare forks workers rather than importing again.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import REPO

PHASE_S = 6.0
MODES = ("quiet", "normal", "background")
TRAINER = """
import json, sys, time, torch
torch.set_num_threads(1)
a = torch.randn(256, 256)
out, end = [], time.time() + float(sys.argv[2])
while time.time() < end:
    t = time.time()
    for _ in range(12):
        a @ a
    time.sleep(0.02)
    out.append((t, time.time() - t))
json.dump(out, open(sys.argv[1], "w"))
"""
NEWCOMER = "import torch, torch._dynamo"


def _phases(rounds):
    return [m for _ in range(rounds) for m in MODES]


def run(rounds=3):
    """{mode: mean step seconds}."""
    sys.path.insert(0, str(REPO))
    from elastic.runner.priority import idle_command, may_return_from_idle
    if not may_return_from_idle():
        return None
    env = dict(os.environ, OMP_NUM_THREADS="1")
    phases = _phases(rounds)
    with tempfile.TemporaryDirectory() as tmp:
        files = [os.path.join(tmp, f"t{i}.json") for i in range(3)]
        length = len(phases) * PHASE_S + 4
        trainers = [subprocess.Popen([sys.executable, "-c", TRAINER, f, str(length)], env=env)
                    for f in files]
        time.sleep(4)                                  # their imports, then steady steps
        start = time.time()
        for i, mode in enumerate(phases):
            end = start + (i + 1) * PHASE_S
            while mode != "quiet" and time.time() < end - 0.5:
                cmd = [sys.executable, "-c", NEWCOMER]
                subprocess.run(idle_command(cmd) if mode == "background" else cmd, env=env,
                               check=False)
            while time.time() < end:
                time.sleep(0.05)
        for t in trainers:
            t.wait()
        steps = [s for f in files for s in json.load(open(f))]
    by_mode = {m: [] for m in MODES}
    for t, seconds in steps:
        i = int((t - start) // PHASE_S)
        if 0 <= i < len(phases) and (t - start) % PHASE_S > 0.3:   # past the switch
            by_mode[phases[i]].append(seconds)
    return {m: statistics.mean(v) for m, v in by_mode.items() if v}


def rows(quick=False):
    means = run(2 if quick else 3)
    metric = ("a newcomer's set-up (import torch, torch._dynamo, back to back) beside 3 "
              "training processes on the 2 cores: their steps' slowdown, the newcomer "
              "started at SCHED_IDLE (as the driver starts a warm spare) "
              "vs at normal priority")
    if means is None:
        return [(metric, "skipped: this process may not leave SCHED_IDLE (not root, "
                         "RLIMIT_NICE < 20) or no chrt")], []
    quiet = means["quiet"]
    slow = {m: means[m] / quiet - 1 for m in ("normal", "background")}
    ratio = slow["background"] / slow["normal"] if slow["normal"] > 0 else float("nan")
    return [(metric, f"+{slow['background'] * 100:.1f} %", f"+{slow['normal'] * 100:.1f} %",
             f"{ratio:.2f}", "—", "—")], [
        f"spawn: mean training step {quiet * 1e3:.1f} ms quiet, "
        f"{means['normal'] * 1e3:.1f} ms beside a normal newcomer, "
        f"{means['background'] * 1e3:.1f} ms beside a background one "
        f"({PHASE_S:.0f} s phases, rotated)"]
