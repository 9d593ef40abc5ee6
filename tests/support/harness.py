"""Plays elasticrun's part for multi-process tests: a store, one round, N workers.

The test process hosts the control store and publishes round 1 with every
worker in it, the way the driver does, so worker-side code can be tested on
real gloo groups before (and independently of) the driver.
"""

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from elastic import protocol as control
from elastic.protocol import ControlStore, Keys

REPO = Path(__file__).resolve().parents[2]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def publish_round(cs, round_id, worker_ids):
    """Write a single-host plan for ``worker_ids`` (ranks in list order), then announce it."""
    n = len(worker_ids)
    members = [{"worker_id": wid, "host": "localhost", "rank": r, "size": n, "local_rank": r,
                "local_size": n, "cross_rank": 0, "cross_size": 1}
               for r, wid in enumerate(worker_ids)]
    cs.put_many({Keys.member(round_id, m["worker_id"]): m for m in members})
    cs.put(Keys.plan(round_id), {"round": round_id, "size": n,
                                 "ids": control.encode_ids(worker_ids)})
    cs.put(Keys.LATEST_ROUND, {"round": round_id})
    threading.Thread(target=_say_assembled, args=(cs, round_id, list(worker_ids)),
                     daemon=True, name="harness-assembly").start()


def _say_assembled(cs, round_id, worker_ids):
    """The driver's other part of a round: once every member arrived, say so
    (unless a newer round replaced it first)."""
    keys = [Keys.joined(round_id, wid) for wid in worker_ids]
    try:
        while True:
            if len(cs.get_present(keys)) == len(keys):
                cs.put(Keys.assembled(round_id), {"round": round_id, "ok": True})
                return
            latest = cs.get(Keys.LATEST_ROUND)
            if latest is not None and latest["round"] > round_id:
                return
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - the test's store went away
        return


def run_workers(script_path, n, timeout=120, extra_env=None, args=()):
    """Run ``n`` copies of ``script_path`` as the workers of round 1.

    Returns one CompletedProcess per rank (stdout/stderr as text). If a worker
    fails, the others get a short grace period and are then killed, so a
    broken test does not wait out a collective timeout. Past ``timeout`` all
    are killed; a killed worker reports a negative return code.
    """
    port, secret = free_port(), secrets.token_hex(16)
    store = control.connect("127.0.0.1", port, timeout, is_master=True)
    cs = ControlStore(store, secret)
    publish_round(cs, 1, [f"w{r}" for r in range(n)])
    env = dict(os.environ)
    env.update({
        control.ENV_ADDR: "127.0.0.1", control.ENV_PORT: str(port), control.ENV_SECRET: secret,
        "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
        "ELASTIC_COLLECTIVE_TIMEOUT": str(timeout),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    })
    env.update(extra_env or {})
    procs, logs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(n):
            out = open(os.path.join(tmp, f"{r}.out"), "w+")
            err = open(os.path.join(tmp, f"{r}.err"), "w+")
            logs.append((out, err))
            cmd = [sys.executable, str(script_path), *map(str, args)]
            procs.append(subprocess.Popen(cmd, env={**env, control.ENV_WORKER_ID: f"w{r}"},
                                          stdout=out, stderr=err, cwd=str(REPO)))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    deadline = min(deadline, time.monotonic() + 10)
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for p, (out, err) in zip(procs, logs):
            out.seek(0)
            err.seek(0)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
            out.close()
            err.close()
    del cs, store
    return results


class Workers:
    """``n`` copies of a script as the workers of round 1, while the test drives rounds.

    ``publish(round_id)`` and ``abort(round_id)`` do what the driver does;
    ``finish()`` waits for the workers (killing them past ``timeout``) and
    returns one CompletedProcess per worker. Use it as a context manager so no
    worker outlives the test.
    """

    def __init__(self, script_path, n, out_dir, extra_env=None, timeout=120):
        self.port, secret = free_port(), secrets.token_hex(16)
        self._store = control.connect("127.0.0.1", self.port, timeout, is_master=True)
        self.control = ControlStore(self._store, secret)
        self.ids = [f"w{r}" for r in range(n)]
        self.out_dir = Path(out_dir)
        self.timeout = timeout
        publish_round(self.control, 1, self.ids)
        env = dict(os.environ)
        env.update({
            control.ENV_ADDR: "127.0.0.1", control.ENV_PORT: str(self.port),
            control.ENV_SECRET: secret, "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
            "ELASTIC_COLLECTIVE_TIMEOUT": str(timeout),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        })
        env.update(extra_env or {})
        self.procs = []
        for wid in self.ids:
            with open(self.out_dir / f"{wid}.out", "w") as out, \
                    open(self.out_dir / f"{wid}.err", "w") as err:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(script_path)], env={**env, control.ENV_WORKER_ID: wid},
                    stdout=out, stderr=err, cwd=str(REPO)))

    def publish(self, round_id):
        publish_round(self.control, round_id, self.ids)

    def abort(self, round_id):
        self.control.put(Keys.abort(round_id), {"round": round_id})

    def wait_for(self, predicate, what, timeout=None):
        deadline = time.monotonic() + (timeout or self.timeout)
        while not predicate():
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError(f"a worker ended before {what}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.logs()}")
            time.sleep(0.01)

    def logs(self):
        return "\n".join(f"--- {wid}\n" + (self.out_dir / f"{wid}.err").read_text()[-3000:]
                         for wid in self.ids)

    def finish(self):
        deadline = time.monotonic() + self.timeout
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill()
        return [subprocess.CompletedProcess(p.args, p.returncode,
                                            (self.out_dir / f"{wid}.out").read_text(),
                                            (self.out_dir / f"{wid}.err").read_text())
                for wid, p in zip(self.ids, self.procs)]

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def check_ok(results):
    """Raise with every worker's output when any worker failed."""
    if all(r.returncode == 0 for r in results):
        return
    report = "\n".join(f"--- rank {i} (exit {r.returncode})\n{r.stdout}\n{r.stderr}"
                       for i, r in enumerate(results))
    raise AssertionError(f"workers failed:\n{report}")
