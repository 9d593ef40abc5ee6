"""Warm spares on local hosts (``elasticrun --warm-spare``): the driver's half.

A spare is a started Python that has imported torch and forks a worker for each spec it
is sent (elastic/launching/spare.py). The driver keeps one on its machine (a joining
agent one on its host), starts it once a round runs (never while the first workers
start), and has it fork every later worker started there: a replacement after a crash
skips the imports, and so does the training beside it. A command that is not
``PYTHON [-u] SCRIPT.py ARGS`` with an existing script gets no spare; its workers start
as they always do, as they do while the spare imports or when it failed.

Its imports would take CPU from the workers training beside it, so where that can be
undone (runner/priority.py) the spare starts at ``SCHED_IDLE``: it gets only CPU nothing
else wants. Once it is ready it is put back to ``SCHED_OTHER`` (it then sleeps until a
spec comes), so it forks at once and its workers start at normal priority.

A forked worker is not our child: ``ForkedWorker`` stands for its ``Popen``, and its
exit code comes from the spare, which reaps it.
"""

from __future__ import annotations

import array
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import IO

from elastic import protocol
from elastic.runner import launcher
from elastic.runner.priority import idle_command, may_return_from_idle, normal_priority

SPARE_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "launching", "spare.py")


def spare_argv(command: Sequence[str]) -> tuple[str, list[str]] | None:
    """(python, [script, args...]) when ``command`` runs a Python script a spare can
    become; None otherwise (another program, ``-m``, ``-c``, or options besides -u)."""
    if len(command) < 2 or not os.path.basename(command[0]).startswith("python"):
        return None
    python = command[0] if os.sep in command[0] else shutil.which(command[0])
    if python is None or not os.access(python, os.X_OK):
        return None
    rest = list(command[1:])
    while rest and rest[0] == "-u":
        rest.pop(0)
    if not rest or not rest[0].endswith(".py") or not os.path.isfile(rest[0]):
        return None
    return python, rest


class Spares:
    """At most one warm spare on this machine; ``take`` has it fork a worker's process.
    Every local host name is this machine, so one spare serves them all."""

    def __init__(self, command: Sequence[str]) -> None:
        self._argv = spare_argv(command)
        self._spare: subprocess.Popen | None = None
        self._conn: socket.socket | None = None
        self._ready = False
        self._exits: dict[int, int] = {}           # forked pid -> exit code, from the spare
        self._pending: list[ForkedWorker] = []     # asked for, pid not known yet
        self._env: dict[str, str] | None = None    # a worker's environment, less ELASTIC_*

    def note_worker(self, env: Mapping[str, str]) -> None:
        """A worker started here with ``env``: the spare is started with that environment
        less every ELASTIC_* variable (ids, ranks and the workers' key reach it in the
        spec, never in /proc/PID/environ)."""
        if self._argv is not None:
            self._env = {k: v for k, v in env.items() if not k.startswith("ELASTIC_")}

    def refill(self) -> bool:
        """Start the spare if there is none (a worker was started here before); True
        when one was started."""
        if self._spare is not None and self._spare.poll() is not None:
            self.close()                          # it died: start another
        if self._argv is None or self._env is None or self._spare is not None:
            return False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [self._argv[0], SPARE_SCRIPT]
        try:
            self._spare = launcher.start_spare(
                idle_command(command) if may_return_from_idle() else command, self._env,
                theirs.fileno())
        except OSError:
            ours.close()
            self._env = None                      # it would fail again: workers start as before
            return False
        finally:
            theirs.close()
        ours.setblocking(False)
        self._conn, self._ready = ours, False
        return True

    def take(self, env: Mapping[str, str]) -> ForkedWorker | None:
        """A worker that ``env`` describes, forked by the spare once it has imported (at
        once when it is ready); None where there is no live spare (start the worker the
        ordinary way)."""
        self.read()
        if self._conn is None or self._argv is None or self._spare is None or \
                self._spare.poll() is not None:
            return None
        env = dict(env)
        if protocol.ENV_DRIVER_PID in env:         # the process it dies with: its parent
            env[protocol.ENV_DRIVER_PID] = str(self._spare.pid)
        spec = json.dumps({"env": env, "argv": self._argv[1]}).encode()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self._conn.sendmsg([spec], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                         array.array("i", [out_w, err_w]))])
        except OSError as exc:
            os.close(out_r)
            os.close(err_r)
            if not isinstance(exc, BlockingIOError):
                self.close()                      # gone: the next refill starts another
            return None                           # (full: it is slow; start it as before)
        finally:
            os.close(out_w)
            os.close(err_w)
        if not self._ready:
            normal_priority(self._spare.pid)      # needed now: its imports at full speed
        worker = ForkedWorker(os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"), self)
        self._pending.append(worker)
        return worker

    def spare_alive(self) -> bool:
        return self._spare is not None and self._spare.poll() is None

    def exit_code(self, pid: int) -> int | None:
        """A forked worker's exit code once it ended (SIGKILL's where the spare died
        first: its workers die with it)."""
        self.read()
        if pid in self._exits:
            return self._exits.pop(pid)
        if not self.spare_alive():
            try:
                os.kill(pid, 0)
                return None                     # the kernel is still killing it
            except ProcessLookupError:
                return -signal.SIGKILL
        return None

    def read(self) -> None:
        """Take what the spare said (call it every tick): ready, the pids of the workers
        it forked (in the order they were asked for), and their exit codes."""
        while self._conn is not None:
            try:
                data = self._conn.recv(4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._ready = False               # it is gone
                return
            message = json.loads(data)
            if message.get("ready"):
                self._ready = True
                if self._spare is not None:
                    normal_priority(self._spare.pid)   # it sleeps now; it must fork at once
            elif "exit" in message:
                self._exits[int(message["exit"])] = int(message["code"])
            elif "pid" in message and self._pending:
                self._pending.pop(0).forked(int(message["pid"]))

    def close(self) -> None:
        """End the spare (and any worker it forked that still runs: they die with it)."""
        spare, conn, self._spare, self._conn, self._ready = \
            self._spare, self._conn, None, None, False
        self._pending = []
        if conn is not None:
            conn.close()
        if spare is not None:
            launcher.end_spare(spare)


class ForkedWorker:
    """The ``Popen`` side of a worker a spare forks: its pid (0 until the spare said it),
    output pipes and exit code. Its process group is its own (it starts a session), as
    an ordinary worker's; a signal sent before its pid is known is sent once it is."""

    stdin = None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def __init__(self, stdout: IO[bytes], stderr: IO[bytes], spares: Spares) -> None:
        self.pid, self.stdout, self.stderr = 0, stdout, stderr
        self.returncode: int | None = None
        self._spares = spares
        self._signal: int | None = None

    def forked(self, pid: int) -> None:
        self.pid = pid
        normal_priority(pid)                      # it did so itself; its threads too
        if self._signal is not None:
            self.signal_group(self._signal)

    def signal_group(self, sig: int) -> None:
        if not self.pid:
            self._signal = sig
            return
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.pid:
                self.returncode = self._spares.exit_code(self.pid)
            else:
                self._spares.read()
                if not self.pid and not self._spares.spare_alive():
                    self.returncode = -signal.SIGKILL     # the spare died before forking it
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0)
            time.sleep(0.02)
        return code

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)
