"""Warm spares on local hosts (``elasticrun --warm-spare``): the driver's half.

A spare is a started Python that has imported torch and waits for a worker's spec on
stdin (elastic/launching/spare.py). The driver keeps one on its machine (a joining agent
one on its host), starts it once a round runs (never while the first workers start),
and hands it the next worker to start there: the replacement after a crash skips the
imports. A command that is not ``PYTHON [-u] SCRIPT.py ARGS`` with an
existing script gets no spare; its workers start as they always do.

Its imports would take CPU from the workers training beside it, so where that can be
undone (runner/priority.py) the spare starts at ``SCHED_IDLE``: it gets only CPU nothing
else wants. ``take`` puts every thread of it back to ``SCHED_OTHER`` before it sends the
spec, so the worker never runs idle.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence

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
    """At most one warm spare on this machine; ``take`` hands it over as a worker's
    process. Every local host name is this machine, so one spare serves them all."""

    def __init__(self, command: Sequence[str]) -> None:
        self._argv = spare_argv(command)
        self._spare: subprocess.Popen | None = None
        self._env: dict[str, str] | None = None    # a worker's environment, less ELASTIC_*

    def note_worker(self, env: Mapping[str, str]) -> None:
        """A worker started here with ``env``: the spare is started with that environment
        less every ELASTIC_* variable (ids, ranks and the workers' key reach it on stdin
        when it becomes a worker, never in /proc/PID/environ)."""
        if self._argv is not None:
            self._env = {k: v for k, v in env.items() if not k.startswith("ELASTIC_")}

    def refill(self) -> bool:
        """Start the spare if there is none (a worker was started here before); True
        when one was started."""
        if self._spare is not None and self._spare.poll() is not None:
            self.close()                          # it died waiting: start another
        if self._argv is None or self._env is None or self._spare is not None:
            return False
        try:
            command = [self._argv[0], SPARE_SCRIPT]
            self._spare = launcher.start_spare(
                idle_command(command) if may_return_from_idle() else command, self._env)
        except OSError:
            self._env = None                      # it would fail again: workers start as before
            return False
        return True

    def take(self, env: Mapping[str, str]) -> subprocess.Popen | None:
        """The spare turned into the worker that ``env`` describes, or None (no live
        spare: start the worker the ordinary way)."""
        popen, self._spare = self._spare, None
        if popen is None or self._argv is None:
            return None
        try:
            if popen.poll() is not None or popen.stdin is None:
                raise OSError("the spare is gone")
            normal_priority(popen.pid)
            popen.stdin.write((json.dumps({"env": dict(env), "argv": self._argv[1]})
                               + "\n").encode())
            popen.stdin.close()
            popen.stdin = None            # a worker's stdin: nothing (closed, not ours)
        except (OSError, ValueError):
            launcher.end_spare(popen)
            return None
        return popen

    def close(self) -> None:
        popen, self._spare = self._spare, None
        if popen is not None:
            launcher.end_spare(popen)
