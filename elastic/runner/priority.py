"""Scheduling priority of the warm spare the driver starts: ``SCHED_IDLE`` while it
imports, so its set-up takes only CPU time the training leaves, and back to
``SCHED_OTHER`` once it has imported or is needed.

The driver starts such a process under ``chrt --idle 0`` and puts every thread of it back
itself, so the process runs no code of ours for it. Only where that can be undone: a
process may leave ``SCHED_IDLE`` when it is root, or when ``RLIMIT_NICE`` >= 20 (sched(7));
elsewhere (or without ``chrt``) processes start as before.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

_CHRT = shutil.which("chrt")


def may_return_from_idle() -> bool:
    """Whether processes started here may leave SCHED_IDLE again."""
    if _CHRT is None or not hasattr(os, "SCHED_IDLE"):
        return False
    if os.geteuid() == 0:
        return True
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return soft == resource.RLIM_INFINITY or soft >= 20


def idle_command(command: Sequence[str]) -> list[str]:
    """``command`` started at SCHED_IDLE (may_return_from_idle must hold)."""
    return [str(_CHRT), "--idle", "0"] + list(command)


def normal_priority(pid: int) -> None:
    """Every thread of process ``pid`` back to SCHED_OTHER (twice: a thread an idle one
    started during the first pass is idle too)."""
    for _ in range(2):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return                   # it has ended
        for tid in tids:
            try:
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass                 # a thread that just ended
