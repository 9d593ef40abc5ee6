"""Worker processes: start them, stream their output, stop them.

Local hosts are plain subprocesses in their own session, so a whole worker
process tree can be killed at once. On Linux they also get PDEATHSIG, so a
SIGKILLed driver never leaves a local orphan; remote workers rely on their
heartbeat noticing the lost store instead.
"""

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading

_SETPRIV = shutil.which("setpriv")


def _die_with_parent(command):
    """Run through setpriv so the kernel kills the worker if the driver dies
    (a preexec_fn is unsafe while output threads run)."""
    if _SETPRIV and sys.platform.startswith("linux"):
        return [_SETPRIV, "--pdeathsig", "SIGKILL", "--"] + list(command)
    return list(command)


def local_names():
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return names


def is_local(host, names=None):
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    return host in (names if names is not None else local_names())


class OutputSink:
    """Prefixes each worker line on the console and optionally keeps per-worker files."""

    def __init__(self, output_dir=None, quiet=False):
        self._dir = output_dir
        self._quiet = quiet
        self._lock = threading.Lock()

    def attach(self, worker_id, stream, name):
        files = None
        if self._dir:
            path = os.path.join(self._dir, f"worker.{worker_id}")
            os.makedirs(path, exist_ok=True)
            files = open(os.path.join(path, name), "ab", buffering=0)
        thread = threading.Thread(target=self._pump, args=(worker_id, stream, name, files),
                                  daemon=True, name=f"output-{worker_id}-{name}")
        thread.start()
        return thread

    def _pump(self, worker_id, stream, name, file):
        target = sys.stdout if name == "stdout" else sys.stderr
        prefix = f"[{worker_id}]<{name}>:"
        try:
            for raw in iter(stream.readline, b""):
                if file is not None:
                    file.write(raw)
                if not self._quiet:
                    line = raw.decode("utf-8", "replace").rstrip("\n")
                    with self._lock:
                        target.write(f"{prefix}{line}\n")
                        target.flush()
        finally:
            stream.close()
            if file is not None:
                file.close()


class WorkerProcess:
    """A started worker and the means to stop it."""

    def __init__(self, worker_id, host, popen, pumps):
        self.worker_id = worker_id
        self.host = host
        self.popen = popen
        self._pumps = pumps

    def poll(self):
        return self.popen.poll()

    def kill(self, sig=signal.SIGKILL):
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def join_output(self, timeout=2.0):
        for pump in self._pumps:
            pump.join(timeout)


def start_local(worker_id, host, command, env, sink):
    popen = subprocess.Popen(
        _die_with_parent(command), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
    )
    pumps = [sink.attach(worker_id, popen.stdout, "stdout"),
             sink.attach(worker_id, popen.stderr, "stderr")]
    return WorkerProcess(worker_id, host, popen, pumps)
