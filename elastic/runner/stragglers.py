"""Stragglers: a worker consistently slower than its peers is named, not silently waited on.

In data-parallel training every rank waits for the slowest at each collective, so one
slow worker (a throttled CPU, a noisy neighbour, a failing disk) sets the whole job's
pace and nothing else shows it. Each heartbeat carries the seconds the worker's
training thread spent waiting on peers so far, and its commits (liveness.py): over a
window of ``window_s`` (default 30 s), a worker's *busy* time per commit is the wall
time it did not wait, divided by its commits. The one whose busy time per commit is at
least ``ratio`` times (default 2) the median of its round's other members is a
straggler: one warning naming it, a ``straggler`` event, and its figure on the progress
line. It is evicted (host blacklisted) only with ``--evict-stragglers``.

Pure functions; ``check`` is the policy's step (it takes the policy's tick).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastic.runner.decisions import Evict, MarkStraggler, Notice, Phase, PolicyTick, Stop
from elastic.runner.stalls import TIMING_KEPT_S, Sample

MIN_COMMITS = 3           # a window with fewer commits says nothing about speed
MIN_BUSY_S = 0.001        # peers that do (almost) nothing but wait give no ratio
MAX_WINDOW_S = TIMING_KEPT_S - 5   # a window longer than the samples kept never fills


@dataclass(frozen=True)
class StragglerRule:
    ratio: float = 2.0        # busy time per commit, against the peers' median
    window_s: float = 30.0    # judged over this much of each worker's recent timing
    evict: bool = False       # --evict-stragglers


def rule(ratio: float = 2.0, window_s: float = 30.0, evict: bool = False) -> StragglerRule:
    """A StragglerRule from the flags; ValueError names a bad one."""
    if not (math.isfinite(ratio) and (ratio == 0 or ratio > 1)):
        raise ValueError(f"--straggler-ratio must be 0 (never) or above 1, got {ratio}")
    if not (math.isfinite(window_s) and 2 <= window_s <= MAX_WINDOW_S):
        raise ValueError(f"--straggler-window must be between 2 and {MAX_WINDOW_S:g} s, "
                         f"got {window_s}")
    return StragglerRule(float(ratio), float(window_s), bool(evict))


def busy_per_commit(timing: Sequence[Sample], window_s: float) -> float | None:
    """Seconds per commit a worker spent not waiting on peers over the last ``window_s``
    of its ``timing`` samples (driver clock, seconds waited, commits); None while they
    do not span the window or hold too few commits."""
    if len(timing) < 2:
        return None
    last = timing[-1]
    first = next((s for s in reversed(timing) if last[0] - s[0] >= window_s), None)
    if first is None or last[2] - first[2] < MIN_COMMITS:
        return None
    return max(0.0, (last[0] - first[0]) - (last[1] - first[1])) / (last[2] - first[2])


def find(busy: Mapping[str, float], ratio: float) -> list[tuple[str, float]]:
    """[(worker id, times its peers' median)] of the workers in ``busy`` (worker id ->
    busy seconds per commit) at least ``ratio`` times slower than the median of the
    others. O(n log n)."""
    if len(busy) < 2:
        return []
    order = sorted(busy.values())
    n = len(order)
    found = []
    for wid, mine in busy.items():
        i = bisect.bisect_left(order, mine)     # drop one copy of its own value
        rest = n - 1
        at = [(rest - 1) // 2, rest // 2]
        middle = [order[j] if j < i else order[j + 1] for j in at]
        median = sum(middle) / 2
        if median >= MIN_BUSY_S and mine >= ratio * median:
            found.append((wid, mine / median))
    return found


def check(tick: PolicyTick) -> None:
    """On a liveness tick of a running round: warn once about each new straggler."""
    job = tick.job
    rule = tick.limits.stragglers or StragglerRule()
    if job.phase is not Phase.RUNNING or len(job.members) < 2 or rule.ratio <= 0:
        return
    busy = {}
    for m in job.members:
        w = tick.workers.get(m.worker_id)
        if w is None or w.stopped or w.liveness is None:
            return                  # the round is changing: its timing says nothing
        value = busy_per_commit(w.liveness.timing, rule.window_s)
        if value is not None:
            busy[m.worker_id] = value
    for wid, times in find(busy, rule.ratio):
        if wid in job.stragglers:
            continue
        host = tick.workers[wid].host
        tick.emit(MarkStraggler(wid))
        tick.emit(Notice(
            f"worker {wid} on {host} is a straggler: {times:.1f}x slower than its peers' "
            f"median over the last {rule.window_s:g} s ({busy[wid]:.3f} s of work per commit); "
            + ("evicting it (--evict-stragglers)" if rule.evict
               else "the job goes at its pace (--evict-stragglers would evict it)"),
            "straggler", (("worker", wid), ("host", host), ("ratio", round(times, 2)))))
        if rule.evict:
            tick.emit(Stop(wid))
            tick.emit(Evict(wid, host))
            tick.host_failed(wid, host, f"worker {wid} on {host} is a straggler "
                                        f"({times:.1f}x slower than its peers); evicted")
