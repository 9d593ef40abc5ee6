"""A restarted serving driver adopts the job its predecessor ran.

In joining mode the agents keep their workers while the driver is away
(runner/agent.py, ``--driver-grace``). A driver started again with the same
command, address and secret hears from them: each agent registers again with
the ids and pids of its live workers (agents.py hands them over here), and each
worker, once its heartbeat goes through, registers again with the newest round
it knows (worker/driver_contact.py). From that, the driver rebuilds:

* a record for every live worker, on its agent's host, with the same id and
  process: nothing restarts;
* the next worker id, past every id in use;
* the next round number, past every round a worker knows (and past the one in
  ``--state-dir``, state_dir.py), so workers take the new round as newer.

Adopted workers are held back from the first round for ADOPTION_WINDOW_S after
the first one came back: agents reconnect within a beat or two, and a round
formed before all of them are back would leave the late ones out (they would
leave the job as removed). A worker also announces itself on its own (its
heartbeat reaches the store even when its agent does not: a partitioned or
stalled agent). While such a worker's agent is not back, the window stays open,
for at most ``wait_s`` (the driver's --worker-timeout, the patience a silent
agent gets anyway), and only while that worker's heartbeat still moves (Strays).
The first round then re-forms from the newest commit any live worker holds (the
sync sends it), so no committed step is lost. An agent that comes back after
that round formed finds its workers gone: they left as removed when they saw
the round without them, and the driver starts new ones on its host.

The decisions are the pure functions below; Adoption only keeps their state.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from elastic.protocol import ControlError, Doorbell, Keys
from elastic.runner.decisions import Job, MemberIds
from elastic.runner.records import WorkerRecord

if TYPE_CHECKING:
    from elastic.control_store import ControlStore
    from elastic.runner.interfaces import LauncherBackend, WorkerHandle

log = logging.getLogger("elasticrun")
ADOPTION_WINDOW_S = 3.0
STRAY_SILENT_S = 5.0        # an announced worker whose heartbeat stood still this long is gone
STRAY_LOOK_S = 0.5          # how often the announcements and their heartbeats are read
MAX_STRAYS = 4096           # bounds what names rung by an outsider can cost


def round_floor(values: Iterable[object], floor: int = 0) -> int:
    """The newest round that any of ``values`` (registrations, beats) names."""
    best = floor
    for value in values:
        if not isinstance(value, dict):
            continue
        for name in ("round", "latest"):
            number = value.get(name)
            if isinstance(number, int) and not isinstance(number, bool) and number > best:
                best = number
    return best


def next_worker_after(current: int, worker_ids: Iterable[str]) -> int:
    """A next worker id that collides with none of ``worker_ids``."""
    numbers = [int(w) for w in worker_ids if str(w).isdigit()]
    return max([current] + [n + 1 for n in numbers])


def free_slots(taken: Collection[int], count: int) -> list[int]:
    """The ``count`` lowest slot numbers not in ``taken``."""
    slots: list[int] = []
    slot = 0
    while len(slots) < count:
        if slot not in taken:
            slots.append(slot)
        slot += 1
    return slots


def window_over(first_at: float | None, now: float, window_s: float = ADOPTION_WINDOW_S,
                awaited: Collection[str] = (), wait_s: float | None = None) -> bool:
    """Whether the adopted workers may form a round: ``window_s`` after the first one came
    back, and once no worker is ``awaited`` (announced, its agent not back), or in any
    case ``wait_s`` after the first one came back."""
    if first_at is None or now - first_at < window_s:
        return False
    return not awaited or (wait_s is not None and now - first_at >= wait_s)


class Strays:
    """Workers that announced themselves to this driver while their agent has not come
    back (pure bookkeeping; Adoption reads the store). Each is awaited while its
    heartbeat still moves: one that stood still for ``silent_s`` is gone (died with its
    agent). Names come from an unsealed doorbell, so only a sealed announcement
    (``adopt``) counts, and there are at most MAX_STRAYS of them."""

    def __init__(self, silent_s: float = STRAY_SILENT_S) -> None:
        self.silent_s = silent_s
        self.beats: dict[str, tuple[Any, float]] = {}   # worker id -> (last beat seen, when it moved)

    def announced(self, worker_id: str, value: object, now: float) -> None:
        if isinstance(value, dict) and value.get("adopt") is True and \
                worker_id not in self.beats and len(self.beats) < MAX_STRAYS:
            self.beats[worker_id] = (None, now)

    def beat(self, worker_id: str, value: object, now: float) -> None:
        if worker_id not in self.beats:
            return
        seen = value.get("beat") if isinstance(value, dict) else None
        last, moved = self.beats[worker_id]
        if seen is not None and seen != last:
            self.beats[worker_id] = (seen, now)

    def awaited(self, claimed: Collection[str], now: float) -> set[str]:
        """Those still awaited: not ``claimed`` (known or ended), heartbeat moving."""
        for wid in [w for w, (_, moved) in self.beats.items()
                    if w in claimed or now - moved > self.silent_s]:
            del self.beats[wid]
        return set(self.beats)


def with_floor(job: Job, floor: int, adopted: Iterable[str] = (),
               host_order: Iterable[str] = ()) -> Job:
    """``job`` whose next round comes after ``floor``, with the ``adopted`` workers
    counted as that round's members: they hold the training state (only before this
    driver's first round); ``host_order`` (rank_order) places their hosts in the plan."""
    if job.members:
        return job
    rounds = dict(job.rounds)
    if adopted:
        rounds[max(floor, job.round_id)] = MemberIds(
            list(rounds.get(max(floor, job.round_id), ())) + sorted(adopted))
    return dataclasses.replace(job, round_id=max(floor, job.round_id), rounds=rounds,
                               host_order=tuple(host_order) or job.host_order)


def rank_order(records: Iterable[WorkerRecord], ranks: Mapping[str, Any]) -> tuple[str, ...]:
    """The adopted workers in the order of their ranks in the previous driver's round
    (``ranks``: worker id -> rank, None when unknown, those last), so rank 0 and its
    side effects (logging, the checkpoint writer) stay on the same worker: each host's
    slots are handed out again in that order (``records`` are changed), and the hosts
    come back in it (the host order the planner takes)."""
    def key(record: WorkerRecord) -> tuple[int, int, int]:
        rank = ranks.get(record.worker_id)
        if isinstance(rank, int) and not isinstance(rank, bool):
            return (0, rank, 0)
        return (1, 0, int(record.worker_id))
    ordered = sorted(records, key=key)
    for host in dict.fromkeys(r.host for r in ordered):
        mine = [r for r in ordered if r.host == host]
        for record, slot in zip(mine, sorted(r.slot for r in mine)):
            record.slot = slot
    return tuple(dict.fromkeys(r.host for r in ordered))


class Adoption:
    """Which workers were adopted, and which wait for the window to pass."""

    def __init__(self, window_s: float = ADOPTION_WINDOW_S, wait_s: float | None = None) -> None:
        self.window_s = window_s
        self.wait_s = wait_s          # longest wait for an announced worker's agent
        self.first_at: float | None = None
        self.waiting: set[str] = set()          # adopted, not yet seen registered
        self.held: set[str] = set()             # adopted and registered: released with the window
        self.count = 0
        # handed over by the hub, host not discovered yet
        self.pending: list[tuple[str, str, WorkerHandle | None]] = []
        self.floor = 0                # the newest round --state-dir remembers
        self.ended: set[str] = set()            # ids of workers that exited while the driver was away
        self.strays = Strays()
        self._bell: Doorbell | None = None    # our own reader of the registrations' doorbell
        self._looked: float | None = None
        self._told = False

    def settled(self) -> bool:
        """Every live worker handed over was adopted and released into a round (or none
        was handed over)."""
        return not (self.pending or self.held or self.waiting)

    def take(self, backend: LauncherBackend | None, workers: Mapping[str, WorkerRecord], job: Job,
             now: float, hosts: Mapping[str, int]) -> tuple[list[WorkerRecord], Job]:
        """New records for the workers ``backend`` (the agent hub) hands over, once
        ``hosts`` (discovered: host -> slots) lists their host, and the job with its next
        worker id past theirs. Before that the policy would stop them as unwanted."""
        self.pending += backend.take_adopted() if backend is not None else []
        records: list[WorkerRecord] = []
        by_host: dict[str, list[tuple[str, WorkerHandle]]] = {}
        later: list[tuple[str, str, WorkerHandle | None]] = []
        ended = [wid for wid, _, handle in self.pending if handle is None]
        self.ended.update(ended)
        if ended:      # workers that exited while the driver was away: their ids stay used
            job = dataclasses.replace(job, next_worker=next_worker_after(job.next_worker, ended))
        for wid, host, handle in self.pending:
            if handle is None or wid in workers or handle.poll() is not None:
                continue
            if host not in hosts:
                later.append((wid, host, handle))
                continue
            by_host.setdefault(host, []).append((wid, handle))
        self.pending = later
        for host, items in by_host.items():
            taken = {w.slot for w in workers.values() if w.host == host and not w.stopped}
            for (wid, handle), slot in zip(items, free_slots(taken, len(items))):
                records.append(WorkerRecord(wid, host, slot, handle, now, heartbeat_at=now))
        if records:
            self.first_at = self.first_at if self.first_at is not None else now
            self.waiting.update(r.worker_id for r in records)
            self.count += len(records)
            job = dataclasses.replace(job, next_worker=next_worker_after(
                job.next_worker, [r.worker_id for r in records] + list(workers)))
            log.info("adopting %d live worker(s) from a previous driver: %s", len(records),
                     ", ".join(f"{r.worker_id} on {r.host}" for r in records))
        return records, job

    def release(self, found: Iterable[str], now: float, job: Job, control: ControlStore,
                workers: Mapping[str, WorkerRecord]) -> tuple[set[str], Job]:
        """Of the workers ``found`` registered: those the driver may count as ready now
        (adopted ones once the window passed), and the job with its round floor."""
        self.held &= set(workers)           # one that exited meanwhile is not held
        self.waiting &= set(workers)
        found = set(found) & set(workers)
        adopted = found & self.waiting
        self.waiting -= adopted
        self.held |= adopted
        ready = found - self.held            # a held one found again (a full look) waits too
        # Adopted but not seen registered yet (a late agent's): the round waits for them too.
        awaited = (self._awaited(control, workers, now) | self.waiting) if self.held else set()
        if self.held and window_over(self.first_at, now, self.window_s, awaited, self.wait_s):
            keys = [Keys.ready(w) for w in self.held] + [Keys.heartbeat(w) for w in self.held]
            try:
                read = control.get_many(keys)
            except ControlError:
                read = {}
            ranks = {w: v.get("rank") for w in self.held
                     if isinstance(v := read.get(Keys.ready(w)), dict)}
            order = rank_order([workers[w] for w in self.held], ranks)
            job = with_floor(job, round_floor(read.values(), max(job.round_id, self.floor)),
                             self.held, order)
            ready |= self.held
            log.info("%d adopted worker(s) are back; the next round is %d", len(self.held),
                     job.round_id + 1)
            if awaited:
                log.warning("worker(s) %s announced themselves, but did not come back with "
                            "their agent within %g s (--worker-timeout): the round forms "
                            "without them", ", ".join(sorted(awaited)), self.wait_s)
            self.held = set()
        elif awaited and not self._told and window_over(self.first_at, now, self.window_s):
            self._told = True
            log.info("waiting up to %g s (--worker-timeout) for the agent of worker(s) %s, "
                     "which announced themselves: training goes on meanwhile",
                     self.wait_s, ", ".join(sorted(awaited)))
        return ready, job

    def _awaited(self, control: ControlStore, workers: Mapping[str, WorkerRecord],
                 now: float) -> set[str]:
        """Announced workers whose agent is not back (read every STRAY_LOOK_S)."""
        if self._looked is not None and now - self._looked < STRAY_LOOK_S:
            return self.strays.awaited(set(workers) | self.ended, now)
        self._looked = now
        try:
            self._bell = self._bell or Doorbell(control, Keys.REGISTERED)
            names = list(dict.fromkeys(
                n for n in self._bell.new_names() if n.isdigit() and n not in workers
                and n not in self.ended and n not in self.strays.beats))[:MAX_STRAYS]
            values = control.get_many([Keys.ready(n) for n in names])
            for wid in names:
                self.strays.announced(wid, values[Keys.ready(wid)], now)
            beats = control.get_many([Keys.heartbeat(w) for w in self.strays.beats])
            for wid in list(self.strays.beats):
                self.strays.beat(wid, beats[Keys.heartbeat(wid)], now)
        except ControlError:
            pass
        return self.strays.awaited(set(workers) | self.ended, now)
