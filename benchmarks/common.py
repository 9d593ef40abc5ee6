"""Shared pieces of the benchmarks: models, statistics, and a tiny stand-in driver.

`launch` plays elasticrun's part the way tests/support/harness.py does (it hosts the
control store and publishes round 1 with every worker in it), so worker-side
code runs on real gloo groups without the driver's start-up costs.
"""

import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


# -- models -------------------------------------------------------------------------------
def mlp_10m():
    """~10M parameters: 1024 -> 2560 -> 2048 -> 1024 -> 10."""
    import torch.nn as nn
    return nn.Sequential(nn.Linear(1024, 2560), nn.ReLU(), nn.Linear(2560, 2048), nn.ReLU(),
                         nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10))


def mlp_1m():
    """~1M parameters: 512 -> 1024 -> 512 -> 10."""
    import torch.nn as nn
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def small_cnn():
    """~0.1M parameters, 32x32 RGB input: compute-bound, little to communicate."""
    import torch.nn as nn
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(128, 10))


def deep_64(layers=200):
    """Many small parameters: ``layers`` Linear(64, 64) layers (weight and bias each), then a
    Linear(64, 10) head. Per-parameter overhead, not bandwidth, decides its step time."""
    import torch.nn as nn
    body = []
    for _ in range(layers):
        body += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*body, nn.Linear(64, 10))


def tiny_mlp():
    """The small model of the elasticrun jobs (recovery, scale-up, restart baseline)."""
    import torch.nn as nn
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def blocks(millions):
    """`millions` x 1M fp32 parameters (1000x1000 matrices), filled without slow init."""
    import torch
    import torch.nn as nn

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.ParameterList(
                nn.Parameter(torch.empty(1000, 1000).uniform_(-0.03, 0.03))
                for _ in range(millions))
    return Blocks()


def batch_for(kind, batch, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    if kind == "cnn":
        x = torch.randn(batch, 3, 32, 32, generator=g)
    else:
        x = torch.randn(batch, {"mlp": 1024, "mlp1m": 512, "tiny": 64, "deep": 64}[kind], generator=g)
    return x, torch.randint(0, 10, (batch,), generator=g)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


# -- statistics ---------------------------------------------------------------------------
def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def write_json(path, obj):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def read_jsonl(directory, pattern):
    """Every whole JSON line of the files in ``directory`` matching ``pattern``; workers are
    still appending, so a line being written is skipped."""
    records = []
    for path in Path(directory).glob(pattern):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


# -- a stand-in driver for worker-side benchmarks -----------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env():
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
                "PYTHONUNBUFFERED": "1"})
    return env


def publish_round(cs, round_id, worker_ids):
    """What the driver does for one single-host round: the tests' harness does it too,
    so a change to the round protocol is made in one place (tests/support/harness.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.harness import publish_round as publish
    publish(cs, round_id, worker_ids)


def launch(script, n, args=(), timeout=240, env=None, addr="127.0.0.1", prefixes=None):
    """Run n copies of `script` as round 1 of a job; returns each rank's result JSON.

    Each worker writes $BENCH_OUT/result.<rank>.json. A failure raises with the
    workers' stderr; past `timeout` every worker is killed. ``addr``: where the control
    store listens; ``prefixes``: an argv prefix per rank (the network bench runs each
    rank in a namespace of its own with ``ip netns exec``).
    """
    from elastic import protocol as control
    from elastic.protocol import ControlStore

    port, secret = free_port(), secrets.token_hex(16)
    store = control.connect(addr, port, timeout, is_master=True)
    cs = ControlStore(store, secret)
    publish_round(cs, 1, [f"b{r}" for r in range(n)])
    with tempfile.TemporaryDirectory(prefix="bench-") as out:
        full_env = base_env()
        full_env.update({control.ENV_ADDR: addr, control.ENV_PORT: str(port),
                         control.ENV_SECRET: secret, "ELASTIC_COLLECTIVE_TIMEOUT": str(timeout),
                         "BENCH_OUT": out, "BENCH_DDP_PORT": str(free_port())})
        full_env.update(env or {})
        procs = []
        for r in range(n):
            err = open(os.path.join(out, f"err.{r}"), "w+")
            procs.append((subprocess.Popen(
                [*(prefixes[r] if prefixes else ()), sys.executable, str(script),
                 *map(str, args)],
                env={**full_env, control.ENV_WORKER_ID: f"b{r}"},
                stdout=None if os.environ.get("BENCH_SHOW") else err,
                stderr=subprocess.STDOUT, cwd=str(REPO)), err))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p, _ in procs):
                    deadline = min(deadline, time.monotonic() + 5)
                time.sleep(0.05)
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        logs = []
        for _p, err in procs:
            err.seek(0)
            logs.append(err.read())
            err.close()
        if any(p.returncode != 0 for p, _ in procs):
            tails = "\n".join(f"--- rank {r} exit {p.returncode}\n{log[-2500:]}"
                              for r, ((p, _), log) in enumerate(zip(procs, logs)))
            raise RuntimeError(f"{Path(script).name} x{n} failed:\n{tails}")
        results = []
        for r in range(n):
            with open(os.path.join(out, f"result.{r}.json")) as f:
                results.append(json.load(f))
    del cs, store
    return results


def run_script(script, args=(), timeout=240, env=None):
    """Run one standalone process (size 1, no elasticrun); returns its result JSON."""
    with tempfile.TemporaryDirectory(prefix="bench-") as out:
        full_env = base_env()
        for name in [k for k in full_env if k.startswith("ELASTIC_")]:
            del full_env[name]      # standalone: size 1, no control store
        full_env.update({"BENCH_OUT": out})
        full_env.update(env or {})
        proc = subprocess.run([sys.executable, str(script), *map(str, args)], env=full_env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=str(REPO), timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{Path(script).name} failed:\n{proc.stdout[-3000:]}")
        with open(os.path.join(out, "result.0.json")) as f:
            return json.load(f)


def print_rows(got, notes):
    """A bench module run alone (``python benchmarks/x.py``): its rows, then its notes."""
    for r in got:
        print(" | ".join(r))
    for n in notes:
        print("-", n)
