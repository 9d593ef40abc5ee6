"""Replacements start in the background: a local worker started while the job can train
without it runs at ``SCHED_IDLE`` until it is ready.

A replacement spends seconds importing torch and building its model before it reaches
``@elastic.run``. On a host where other workers train (more slots than one, or hosts
that share a machine), that start-up takes CPU from the steps of the whole job: every
peer waits for the slowest rank. So where the job has ``--min-np`` ready workers without
the newcomer, the driver starts it under ``chrt --idle 0``: its set-up gets only the CPU
the training leaves idle. The driver puts every thread of it back to ``SCHED_OTHER``
(rule: ``restore_due``) as soon as it is ready, as soon as the job needs it (fewer than
``--min-np`` ready workers), or after IDLE_AT_MOST_S, so that a host whose CPUs the
training keeps busy delays a newcomer by that much at most.

Only where the driver may undo it (runner/priority.py), and only for workers it starts
itself on its own machine; agents and ssh hosts start workers as before (a warm spare
waits at ``SCHED_IDLE`` too: runner/spares.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from elastic.runner.priority import may_return_from_idle, normal_priority
from elastic.runner.records import WorkerRecord

IDLE_AT_MOST_S = 10.0


def start_in_background(ready_others: int, min_np: int) -> bool:
    """Whether a newcomer may start idle: the job trains without it."""
    return ready_others >= max(1, min_np)


def restore_due(idle_s: float, ready: bool, ready_others: int, min_np: int) -> bool:
    """Whether a worker started idle goes back to normal priority now."""
    return ready or not start_in_background(ready_others, min_np) or idle_s >= IDLE_AT_MOST_S


class BackgroundStarts:
    """The driver's workers that run idle now, and the call that puts them back."""

    def __init__(self) -> None:
        self.enabled = may_return_from_idle()
        self._idle: dict[str, tuple[int, float]] = {}     # worker id -> (pid, started)

    def wanted(self, workers: Mapping[str, WorkerRecord], min_np: int) -> bool:
        return self.enabled and start_in_background(_ready(workers), min_np)

    def started(self, worker_id: str, pid: int, now: float) -> None:
        self._idle[worker_id] = (pid, now)

    def settle(self, workers: Mapping[str, WorkerRecord], min_np: int, now: float) -> list[str]:
        """Put back those whose time came (restore_due); returns their ids."""
        if not self._idle:
            return []
        ready_now = _ready(workers)
        back = []
        for wid, (pid, started) in list(self._idle.items()):
            w = workers.get(wid)
            if w is None or w.stopped:
                del self._idle[wid]
                continue
            if restore_due(now - started, w.ready, ready_now - int(w.ready), min_np):
                normal_priority(pid)
                del self._idle[wid]
                back.append(wid)
        return back


def _ready(workers: Mapping[str, WorkerRecord]) -> int:
    return sum(1 for w in workers.values() if w.ready and not w.stopped)
