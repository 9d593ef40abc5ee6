"""Run real elasticrun jobs of tests/workloads/train_job.py and read what they wrote.

Waits poll for files with generous deadlines: these tests must pass on a
slow, loaded 2-core machine, so nothing here sleeps a fixed time.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "tests" / "workloads" / "train_job.py"
ELASTICRUN = [sys.executable, "-m", "elastic.runner"]
DEADLINE_S = 240


class Job:
    def __init__(self, tmp_path, args, hosts=None, env=None, script=WORKLOAD, script_args=()):
        self.dir = Path(tmp_path)
        self.out = self.dir / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "elasticrun.log"
        self.args = list(args)
        if hosts is not None:
            self.hosts_file = self.dir / "hosts.txt"
            self.set_hosts(hosts)
            script_path = self.dir / "discover.sh"
            script_path.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
            script_path.chmod(0o755)
            self.args = ["--host-discovery-script", str(script_path),
                         "--discovery-interval", "0.3"] + self.args
        self.env = dict(os.environ, JOB_OUT=str(self.out), OMP_NUM_THREADS="1",
                        PYTHONPATH=str(REPO), **(env or {}))
        self.env.setdefault("ELASTIC_JOBS_DIR", str(self.dir / "jobs"))   # elasticctl's, not ~'s
        self.script = script
        self.script_args = [str(a) for a in script_args]
        self.proc = None
        self.prefix = []         # an argv prefix for elasticrun (netlab: its namespace)

    def set_hosts(self, hosts):
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("\n".join(hosts) + "\n")
        tmp.rename(self.hosts_file)

    def start(self):
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.prefix + ELASTICRUN + self.args + [sys.executable, str(self.script)]
            + self.script_args,
            env=self.env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
            start_new_session=True)
        return self

    def output(self):
        return self.log_path.read_text(errors="replace")

    def steps(self):
        records = []
        for path in self.out.glob("steps.*.jsonl"):
            for line in path.read_text().splitlines():
                if line.strip():
                    records.append(json.loads(line))
        return records

    def wait_for(self, predicate, what, timeout=DEADLINE_S):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if self.proc.poll() is not None and not predicate():
                raise AssertionError(f"job ended before {what}:\n{self.output()[-4000:]}")
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}:\n{self.output()[-4000:]}")

    def wait_step(self, step, size=None):
        self.wait_for(lambda: any(r["step"] >= step and (size is None or r["size"] == size)
                                  for r in self.steps()),
                      f"step {step}" + (f" at size {size}" if size else ""))

    def release(self, step):
        (self.out / f"go.{step}").write_text("go")

    def finish(self, timeout=DEADLINE_S):
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"job hung:\n{self.output()[-4000:]}") from None
        finally:
            self.close_log()
        return code

    def close_log(self):
        self._log.close()

    def run(self, timeout=DEADLINE_S):
        self.start()
        return self.finish(timeout)

    # -- checks ------------------------------------------------------------------
    def finals(self):
        return [json.loads(p.read_text()) for p in sorted(self.out.glob("final.*.json"))]

    def worker_envs(self):
        return [json.loads(p.read_text()) for p in sorted(self.out.glob("env.*.json"))]

    def history(self):
        return json.loads((self.out / "history.json").read_text())

    def assert_ok(self, code, epochs=3, samples=48, final_size=None):
        assert code == 0, self.output()[-4000:]
        finals = self.finals()
        size = finals[0]["size"]
        assert len(finals) == size, finals
        if final_size is not None:
            assert size == final_size, finals
        for key in ("params", "optimizer", "sampler", "step"):
            assert len({json.dumps(f[key]) for f in finals}) == 1, (key, finals)
        assert_exactly_once(self.history(), epochs, samples)
        assert_memberships(self.steps())
        return finals


def assert_exactly_once(history, epochs, samples):
    """Committed history: steps 1..N once each; each epoch trains every sample once
    (duplicates only as padding in the epoch's last step)."""
    steps = [h[1] for h in history]
    assert steps == list(range(1, len(steps) + 1)), steps
    for epoch in range(epochs):
        entries = [h for h in history if h[0] == epoch]
        assert entries, f"epoch {epoch} missing"
        body = [i for h in entries[:-1] for i in h[2]]
        assert len(body) == len(set(body)), f"epoch {epoch}: a sample trained twice"
        assert set(body) | set(entries[-1][2]) == set(range(samples)), f"epoch {epoch} incomplete"
        assert not set(body) - set(range(samples))


def assert_memberships(records):
    """Within each (round, step), ranks are 0..size-1 once; local ranks fit local sizes."""
    by_key = {}
    for r in records:
        assert 0 <= r["rank"] < r["size"], r
        by_key.setdefault((r["round"], r["step"]), []).append(r)
    for (round_id, step), rs in by_key.items():
        ranks = sorted(r["rank"] for r in rs)
        # A rank that died mid-step may be missing, never duplicated.
        assert len(ranks) == len(set(ranks)), (round_id, step, rs)
        for r in rs:
            assert r["local_rank"] < r["size"]


def sizes_in_order(records):
    """World sizes by round, in round order."""
    seen = {}
    for r in sorted(records, key=lambda r: r["round"]):
        seen.setdefault(r["round"], r["size"])
    return [seen[k] for k in sorted(seen)]


def hosts_by_rank(records, round_id):
    return {r["rank"]: r["host"] for r in records if r["round"] == round_id}


def kill_leftover_jobs(started):
    """Teardown for tests that may fail mid-job: SIGKILL each still-running elasticrun
    (its workers die with it: PDEATHSIG), so a failed test leaves no job behind."""
    for job in started:
        if job.proc is not None and job.proc.poll() is None:
            try:
                os.killpg(job.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            job.proc.wait(30)


def wait_unlocked(directory, timeout=60):
    """A killed job's workers die with their driver; then its checkpoint lock is free."""
    from filelock import FileLock, Timeout
    lock = FileLock(os.path.join(directory, "LOCK"))
    deadline = time.monotonic() + timeout
    while True:
        try:
            lock.acquire(timeout=0)
            lock.release()
            return
        except Timeout:
            assert time.monotonic() < deadline, "the killed job still holds the lock"
            time.sleep(0.1)
