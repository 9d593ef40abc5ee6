"""Stalls: a rank whose training thread stopped while its peers wait on it. Pure functions.

Heartbeats prove that a process lives; the progress they carry (completed
waits and commits, and what the training thread waits in now) shows whether
it trains. A rank is stuck when it has made no progress for ``--stall-timeout``
while peers of one of its rounds have waited that long on it, in a collective
or for the round to assemble. A rank busy alone (rank 0 evaluating between
commits while nobody waits on it) is not a stall. One warning comes first, at
half the timeout or after 60 s, whichever is sooner.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

WARN_AT_MOST_S = 60.0
TIMING_EVERY_S = 2.0     # stragglers.py: a worker's timing samples, one per 2 s,
TIMING_KEPT_S = 65.0     # ... for this long (--straggler-window is at most 60 s)
SETUP_WAITS = ("group set-up", "group check")
Sample = tuple[float, float, int]   # timing: (driver clock, seconds waited on peers, commits)


@dataclass
class Liveness:
    """What the driver knows about one worker's training thread."""

    beat: int = 0
    beat_at: float = 0.0          # driver clock when ``beat`` last changed
    progress: tuple = ()          # (waits, commits) as last reported
    progress_at: float = 0.0      # driver clock when ``progress`` last changed
    waiting: dict | None = None   # {"what", "round", "on_peers", "seconds"} or None
    warned: bool = False          # the stall warning for this episode was printed
    leaving: bool = False
    commit_count: int = 0         # for elasticctl: commits, when the count last moved, a rate
    commit_at: float = 0.0
    commit_rate: float | None = None   # commits per second (smoothed over beats)
    seconds: dict | None = None   # {"commit": s, "sync": s}: how long the last ones took
    holds: int = -1               # the commit its state holds (-1: none yet; holders.py)
    durable: int = -1             # the newest checkpoint it wrote or resumed from
    timing: tuple = ()            # (driver clock, seconds waited on peers, commits) samples

    def update(self, value: Mapping[str, Any], now: float) -> bool:
        """Take a heartbeat value; True when it is a new beat."""
        beat = int(value.get("beat", 0))
        if beat == self.beat:
            return False
        self.beat, self.beat_at = beat, now
        progress = (int(value.get("waits", 0)), int(value.get("commits", 0)))
        waiting = value.get("waiting")
        if progress != self.progress or _wait_key(waiting) != _wait_key(self.waiting):
            self.progress, self.progress_at = progress, now
            self.warned = False
        self.waiting = waiting if isinstance(waiting, dict) else None
        self.leaving = bool(value.get("leaving"))
        self.count_commits(progress[1], now)
        seconds = value.get("seconds")
        self.seconds = seconds if isinstance(seconds, dict) else None
        self.holds = int(value.get("holds", -1))
        self.durable = int(value.get("durable", -1))
        if "waited" in value:
            self.timing = timing_window(self.timing, (now, float(value["waited"]), progress[1]))
        return True

    def count_commits(self, commits: int, now: float) -> None:
        if commits == self.commit_count:
            return
        if self.commit_at and commits > self.commit_count and now > self.commit_at:
            rate = (commits - self.commit_count) / (now - self.commit_at)
            self.commit_rate = rate if self.commit_rate is None else (self.commit_rate + rate) / 2
        self.commit_count, self.commit_at = commits, now

    def waited(self, now: float) -> float:
        """How long it has waited on peers, as of now; 0 when it does not."""
        w = self.waiting
        if not w or not w.get("on_peers", True):
            return 0.0
        return float(w.get("seconds", 0.0)) + max(0.0, now - self.beat_at)


def timing_window(samples: tuple[Sample, ...], sample: Sample) -> tuple[Sample, ...]:
    """``samples`` plus ``sample``: one per TIMING_EVERY_S (the newest replaces a closer
    one), none older than TIMING_KEPT_S but one: bounded, whatever the job's length."""
    if len(samples) >= 2 and sample[0] - samples[-2][0] < TIMING_EVERY_S:
        samples = samples[:-1]
    samples = samples + (sample,)
    while len(samples) > 2 and sample[0] - samples[1][0] >= TIMING_KEPT_S:
        samples = samples[1:]
    return samples


def _wait_key(waiting):
    if not isinstance(waiting, dict):
        return None
    return waiting.get("what"), waiting.get("round")


@dataclass(frozen=True)
class Stall:
    worker_id: str
    action: str          # "warn", "evict" or "abort" (of ``round_id``, an older round it waits in)
    idle_s: float
    waiters: int
    what: str
    round_id: int = 0


@dataclass
class StallView:
    """One live worker as find_stalls sees it."""

    worker_id: str
    liveness: Liveness
    rounds: set = field(default_factory=set)     # live rounds it is a member of


BEAT_S = 1.0          # a worker's heartbeat interval in a job of up to 2,048 workers
READ_BEATS_S = 0.5    # how often the driver reads them then
BEATS_PER_S = 2048    # ... beyond which beats slow down, so the store serves about this many
VERIFIED_PER_S = 1024  # ... and reads slow down, so the driver verifies about this many seals
EXIT_POLLS_PER_S = 20480   # process polls per second, at most (at 50 ms ticks: 1,024 per tick)


def heartbeat_interval(workers: int, worker_timeout: float, base: float = BEAT_S) -> float:
    """Seconds between one worker's beats: ``base``, slower in a big job (2 s at 4,096
    workers: every beat is a store request the driver's process serves), but never
    slower than a tenth of --worker-timeout, after which a silent worker is evicted
    (a 1.5 s timeout beats every 0.15 s: a short timeout is what its user asked for)."""
    return min(max(base, workers / BEATS_PER_S), worker_timeout / 10)


def heartbeat_read_interval(workers: int, worker_timeout: float) -> float:
    """Seconds between the driver's reads of every beat: READ_BEATS_S, slower in a big
    job (each read verifies n seals: 4 s at 4,096 workers), at most a tenth of
    --worker-timeout (exits are seen within exit_poll_interval). Under a timeout below
    5 s the beats are read as often as they are written: a read every half second would
    add up to a third of a 1.5 s timeout to every hang's detection."""
    least = min(READ_BEATS_S, worker_timeout / 10)
    return min(max(least, workers / VERIFIED_PER_S), max(least, worker_timeout / 10))


def exit_poll_interval(workers: int, tick: float) -> float:
    """Seconds between the driver's polls of every worker process: each ``tick`` in a
    small job, slower in a big one (0.2 s at 4,096), so polling stays a small cost."""
    return max(tick, workers / EXIT_POLLS_PER_S)


class StallTimeout(float):
    """--stall-timeout with its own warning time (horovodrun's
    --stall-check-warning-time-seconds); a plain float warns at the default."""

    def __new__(cls, seconds, warn_s=None):
        value = super().__new__(cls, seconds)
        value.warn_s = warn_s
        return value


def warn_after(stall_timeout: float) -> float:
    warn_s = getattr(stall_timeout, "warn_s", None)
    if warn_s is not None:
        return min(warn_s, float(stall_timeout))
    return min(stall_timeout / 2.0, WARN_AT_MOST_S)


def long_waits(livenesses: Iterable[Liveness], stall_timeout: float, now: float) -> bool:
    """Whether any rank has waited on peers long enough for find_stalls to act on someone:
    each of its rules needs a peer that waited at least ``warn_after``. O(n), no views."""
    least = warn_after(stall_timeout)
    for live in livenesses:
        if not live.waiting:
            continue
        waited = live.waited(now)
        if waited > 0 and waited >= least:
            return True
    return False


class _Waiters:
    """The ranks waiting in one round: how many, what in, and the two longest waits."""

    __slots__ = ("count", "names", "top")

    def __init__(self):
        self.count, self.names, self.top = 0, {}, []

    def add(self, index, waited, what):
        self.count += 1
        self.names[what] = self.names.get(what, 0) + 1
        self.top = sorted(self.top + [(waited, index)], reverse=True)[:2]

    def longest_except(self, index):
        return max((w for w, i in self.top if i != index), default=None)


def find_stalls(views: Iterable[StallView], stall_timeout: float, now: float) -> list[Stall]:
    """The stalls to act on now, at most one per worker.

    A busy rank (not waiting) is stuck once both its own silence and its
    peers' wait on it pass the threshold. A rank that itself waits in an
    older round than the one its peers wait in (it missed that round's abort)
    is not blamed: that older round is aborted instead. O(n x rounds): the
    waiting ranks are grouped by the round they wait in.
    """
    views = list(views)
    if not long_waits((v.liveness for v in views), stall_timeout, now):
        return []
    by_round: dict[Any, _Waiters] = {}
    for i, v in enumerate(views):
        seconds = v.liveness.waited(now)
        waiting = v.liveness.waiting or {}
        if seconds > 0:
            round_id = waiting.get("round")
            try:
                group = by_round.setdefault(round_id, _Waiters())
            except TypeError:
                continue                  # not a round id: in no view's rounds
            group.add(i, seconds, waiting.get("what", "?"))
    out = []
    for i, view in enumerate(views):
        me = view.liveness
        if me.leaving:
            continue
        idle = now - me.progress_at
        in_rounds = [(r, by_round[r]) for r in set(view.rounds) if r in by_round]
        mine_waited = me.waited(now) > 0
        my_round = (me.waiting or {}).get("round") if mine_waited else None
        count = 0
        waited: float | None = None
        peer_round: int | None = None
        names: dict[str, int] = {}
        for r, group in in_rounds:
            me_here = mine_waited and my_round == r
            n = group.count - (1 if me_here else 0)
            if n <= 0:
                continue
            count += n
            longest = group.longest_except(i) if me_here else group.top[0][0]
            waited = longest if waited is None else max(waited, longest)
            for name, k in group.names.items():
                names[name] = names.get(name, 0) + k
            if me_here:
                what = (me.waiting or {}).get("what", "?")
                names[what] -= 1
            peer_round = int(r) if peer_round is None else max(peer_round, int(r))
        if not count or waited is None or peer_round is None:
            continue                  # (a counted round sets both)
        what = max(sorted(name for name, k in names.items() if k > 0), key=lambda n: names[n])
        mine = me.waiting
        if mine is not None and not mine.get("on_peers", True):
            continue                  # it waits for the driver, not for anyone
        if mine is not None:
            # Set-up waits only: one in a collective waits on a peer, who is the one
            # to blame (or not) in its own right.
            older = int(mine.get("round", 0))
            if older < peer_round and older in view.rounds and mine.get("what") in SETUP_WAITS \
                    and min(idle, waited) >= stall_timeout:
                out.append(Stall(view.worker_id, "abort", idle, count, what, older))
            continue
        stalled_for = min(idle, waited)
        if stalled_for >= warn_after(stall_timeout) and not me.warned:
            # Always warned before evicted, even when a slow tick came late.
            out.append(Stall(view.worker_id, "warn", idle, count, what))
        elif stalled_for >= stall_timeout:
            out.append(Stall(view.worker_id, "evict", idle, count, what))
    return out


def describe(stall: Stall, host: str) -> str:
    peers = f"{stall.waiters} peer{'s' if stall.waiters != 1 else ''}"
    wait = "waits" if stall.waiters == 1 else "wait"
    return (f"worker {stall.worker_id} on {host}: no progress for {stall.idle_s:.0f} s "
            f"while {peers} {wait} in {stall.what}")
