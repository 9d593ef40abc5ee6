"""A serving driver and joining agents on loopback, as real processes.

Each agent plays one node or pod (its own --host-name). The commands built
here are the ones the Kubernetes and Slurm examples run (tests/test_cluster_examples.py
checks that their flags agree with SERVE_FLAGS and JOIN_FLAGS).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import free_port
from jobs import REPO, WORKLOAD, Job

ELASTICRUN = [sys.executable, "-m", "elastic.runner"]
# The flags every cluster example passes, besides -np/--min-np/--max-np.
SERVE_FLAGS = ("--serve", "--port", "--secret-file", "--stop-timeout")
JOIN_FLAGS = ("--join", "--secret-file", "--slots", "--host-name", "--stop-timeout")


class JoinJob(Job):
    """A Job whose driver serves (no hosts of its own) and whose agents join it."""

    def __init__(self, tmp_path, args, env=None, secret="join-test-secret"):
        super().__init__(tmp_path, args, env=env)
        self.port = free_port()
        self.secret_file = self.dir / "secret"
        self.secret_file.write_text(secret + "\n")
        self.secret_file.chmod(0o600)
        self.agents = {}

    def start(self):
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            ELASTICRUN + ["--serve", "--port", str(self.port), "--secret-file",
                          str(self.secret_file), "--stop-timeout", "20"] + self.args,
            env=self.env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
            start_new_session=True)
        return self

    def join(self, name, slots=1, secret_file=None, extra=()):
        log = open(self.dir / f"agent.{name}.log", "wb")
        proc = subprocess.Popen(
            ELASTICRUN + ["--join", f"127.0.0.1:{self.port}", "--secret-file",
                          str(secret_file or self.secret_file), "--slots", str(slots),
                          "--host-name", name, "--stop-timeout", "20", *extra,
                          sys.executable, str(WORKLOAD)],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
            start_new_session=True)
        self.agents[name] = (proc, log)
        return proc

    def agent_output(self, name):
        return (self.dir / f"agent.{name}.log").read_text(errors="replace")

    def wait_agent(self, name, timeout=120):
        proc, log = self.agents[name]
        try:
            return proc.wait(timeout)
        finally:
            log.close()

    def signal_agent(self, name, signum):
        os.kill(self.agents[name][0].pid, signum)

    def cleanup(self):
        for proc, log in self.agents.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def wait_until(predicate, what, timeout=120, output=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{output()[-4000:]}")


__all__ = ["JoinJob", "SERVE_FLAGS", "JOIN_FLAGS", "wait_until", "Path"]
