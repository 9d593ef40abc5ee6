"""The pause a serving driver's restart causes (issue 27), for `make bench`.

A joining-mode job (elasticrun --serve, two agents, benchmarks/job_worker.py)
trains; the driver is SIGKILLed and the same command started again at once.
The workers train on through the outage, so the training time lost is the time
from the kill to the adopted round's first step that was not spent on steps:
(t_first_adopted_step - t_kill) - steps_done_meanwhile * median_step. The
restart itself (importing elastic, listening) costs nothing here as long as the
workers keep training through it, so it is excluded by construction.
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

import common
from common import BENCH, REPO

ELASTICRUN = [sys.executable, "-m", "elastic.runner"]


def _steps(out, rank=0):
    recs = []
    for path in out.glob("steps.*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec["rank"] == rank:
                recs.append(rec)
    return sorted(recs, key=lambda r: r["t"])


def _wait(pred, what, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def run_once():
    """(lost seconds, median step seconds before the kill, detail) of one kill-and-restart."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-driver-restart-"))
    out = tmp / "out"
    out.mkdir()
    secret = tmp / "secret"
    secret.write_text(os.urandom(16).hex() + "\n")
    port = common.free_port()
    env = common.base_env()
    env.update({"BENCH_OUT": str(out), "BENCH_STEP_SLEEP": "0.01", "BENCH_MAX_STEPS": "100000"})
    serve = ELASTICRUN + ["--serve", "--port", str(port), "--secret-file", str(secret), "-np", "2"]
    procs = []

    def start(argv, name):
        log = open(tmp / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                cwd=str(REPO), start_new_session=True)
        procs.append(proc)
        return proc
    try:
        driver = start(serve, "driver")
        for i in range(2):
            start(ELASTICRUN + ["--join", f"127.0.0.1:{port}", "--secret-file", str(secret),
                                "--host-name", f"node-{i}", sys.executable,
                                str(BENCH / "job_worker.py")], f"agent{i}")
        _wait(lambda: len(_steps(out)) >= 80, "80 steps")
        before = _steps(out)
        kill_round = before[-1]["round"]
        t_kill = time.time()
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        driver = start(serve, "driver")
        _wait(lambda: sum(r["round"] > kill_round for r in _steps(out)) >= 20,
              "20 steps of the adopted round")
        (out / "stop").write_text("stop")
        driver.wait(120)
        steps = _steps(out)
        intervals = [b["t"] - a["t"] for a, b in zip(before[20:], before[21:])]
        step_s = statistics.median(intervals)
        first = next(r for r in steps if r["round"] > kill_round)
        meanwhile = sum(1 for r in steps if t_kill < r["t"] < first["t"])
        lost = max(0.0, (first["t"] - t_kill) - meanwhile * step_s)
        old = [r for r in steps if r["round"] == kill_round and r["t"] < first["t"]]
        reform = first["t"] - old[-1]["t"] - step_s if old else None
        detail = (f"kill→first adopted step {first['t'] - t_kill:.2f} s (the restart "
                  f"included), {meanwhile} steps trained meanwhile at a median "
                  f"{step_s * 1e3:.1f} ms; the round change itself "
                  f"{'—' if reform is None else f'{max(reform, 0.0) * 1e3:.0f} ms'} beyond a step")
        return lost, step_s, detail
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    print(run_once())
