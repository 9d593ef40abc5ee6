"""The pause a serving driver's restart causes (issue 27), for `make bench`.

A joining-mode job (elasticrun --serve, two agents, benchmarks/job_worker.py)
trains; the driver is SIGKILLed and the same command started again at once.
The workers train on through the outage, so the training time lost is the time
between the kill and the adopted round's first step during which no step
completed: each gap between rank 0's steps there that is longer than two
median steps of the same window counts, less one step. The restart itself
(importing elastic and torch: seconds of CPU on the workers' own 2 cores here)
slows every step a little without stopping any; that is the restart, which the
row excludes, and the detail gives it as the step rate before and during the
outage. The same stall count over the steady steps before the kill is the machine's
own noise, given alongside.
"""

import json
import os
import signal
import socket
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


def _port_open(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _wait(pred, what, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def stalled(times, step_s):
    """Seconds in which no step completed: each gap between consecutive ``times`` longer
    than two ``step_s``, less one step."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    return sum(g - step_s for g in gaps if g > 2 * step_s)


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
        _wait(lambda: len(_steps(out)) >= 200, "200 steps")
        before = _steps(out)
        kill_round = before[-1]["round"]
        t_kill = time.time()
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        driver = start(serve, "driver")
        _wait(lambda: _port_open(port), "the new driver to listen")
        t_listening = time.time()
        _wait(lambda: sum(r["round"] > kill_round for r in _steps(out)) >= 20,
              "20 steps of the adopted round")
        (out / "stop").write_text("stop")
        driver.wait(120)
        steps = _steps(out)
        first = next(r for r in steps if r["round"] > kill_round)
        span = first["t"] - t_kill
        last = max(r["t"] for r in steps if r["t"] <= t_kill)     # the step before the kill
        window = [r["t"] for r in steps if last <= r["t"] <= first["t"]]
        gaps = [b - a for a, b in zip(window, window[1:])]
        step_s = statistics.median(gaps)
        lost = stalled(window, step_s)
        calm = [r["t"] for r in steps if r["step"] >= 50 and r["t"] <= t_kill]
        noise = stalled(calm, statistics.median([b - a for a, b in zip(calm, calm[1:])]))
        rate = (len(calm) - 1) / (calm[-1] - calm[0])
        old = [r for r in steps if r["round"] == kill_round and r["t"] < first["t"]]
        reform = first["t"] - old[-1]["t"] - step_s if old else None
        detail = (f"kill→new driver listening {t_listening - t_kill:.1f} s, kill→first "
                  f"adopted step {span:.2f} s, {len(window) - 2} steps trained meanwhile "
                  f"({(len(window) - 2) / span:.0f}/s; {rate:.0f}/s before the kill), stalls "
                  f"{lost:.2f} s (in the {calm[-1] - calm[0]:.1f} s before the kill: "
                  f"{noise:.2f} s), the "
                  f"round change {'—' if reform is None else f'{max(reform, 0.0) * 1e3:.0f} ms'}"
                  " beyond a step")
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
