"""A serving driver and joining agents on loopback, as real processes.

Each agent plays one node or pod (its own --host-name). The commands built
here are the ones the Kubernetes and Slurm examples run (tests/test_cluster_examples.py
checks that their flags are those of serve_args and join_args).
"""

import os
import signal
import subprocess
import sys

from support.harness import free_port
from support.jobs import REPO, WORKLOAD, Job

ELASTICRUN = [sys.executable, "-m", "elastic.runner"]


def serve_args(port, secret_file):
    """The driver's flags, as the tests and the cluster examples pass them."""
    return ["--serve", "--port", str(port), "--secret-file", str(secret_file),
            "--stop-timeout", "20"]


def join_args(address, secret_file, slots, name):
    """An agent's flags, as the tests and the cluster examples pass them."""
    return ["--join", address, "--secret-file", str(secret_file), "--slots", str(slots),
            "--host-name", name, "--stop-timeout", "20"]


class JoinJob(Job):
    """A Job whose driver serves (no hosts of its own) and whose agents join it."""

    def __init__(self, tmp_path, args, env=None, secret="join-test-secret"):
        super().__init__(tmp_path, args, env=env)
        self.port = free_port()
        self.secret_file = self.dir / "secret"
        self.secret_file.write_text(secret + "\n")
        self.secret_file.chmod(0o600)
        self.agents = {}

    def serve_command(self):
        return ELASTICRUN + serve_args(self.port, self.secret_file) + self.args

    def join_command(self, name, slots=1, extra=()):
        return ELASTICRUN + join_args(f"127.0.0.1:{self.port}", self.secret_file, slots, name) \
            + list(extra) + [sys.executable, str(WORKLOAD)]

    def start(self):
        return self._serve("wb")

    def join(self, name, slots=1, extra=()):
        log = open(self.dir / f"agent.{name}.log", "wb")
        proc = subprocess.Popen(
            self.join_command(name, slots, extra), env=self.env, stdout=log,
            stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        self.agents[name] = (proc, log)
        return proc

    def restart_driver(self):
        """The same serving command again (after the driver died), its output appended."""
        return self._serve("ab")

    def _serve(self, mode):
        self._log = open(self.log_path, mode)
        self.proc = subprocess.Popen(
            self.serve_command(), env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            cwd=REPO, start_new_session=True)
        return self

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


