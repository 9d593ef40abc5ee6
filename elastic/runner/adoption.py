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
leave the job as removed). The first round then re-forms from the newest commit
any live worker holds (the sync sends it), so no committed step is lost.

The decisions are the pure functions below; Adoption only keeps their state.
"""

import dataclasses
import logging

from elastic.protocol import ControlError, Keys
from elastic.runner.decisions import MemberIds
from elastic.runner.records import WorkerRecord

log = logging.getLogger("elasticrun")
ADOPTION_WINDOW_S = 3.0


def round_floor(values, floor=0):
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


def next_worker_after(current, worker_ids):
    """A next worker id that collides with none of ``worker_ids``."""
    numbers = [int(w) for w in worker_ids if str(w).isdigit()]
    return max([current] + [n + 1 for n in numbers])


def free_slots(taken, count):
    """The ``count`` lowest slot numbers not in ``taken``."""
    slots, slot = [], 0
    while len(slots) < count:
        if slot not in taken:
            slots.append(slot)
        slot += 1
    return slots


def window_over(first_at, now, window_s=ADOPTION_WINDOW_S):
    return first_at is not None and now - first_at >= window_s


def with_floor(job, floor, adopted=()):
    """``job`` whose next round comes after ``floor``, with the ``adopted`` workers
    counted as that round's members: they hold the training state (only before this
    driver's first round)."""
    if job.members:
        return job
    rounds = dict(job.rounds)
    if adopted:
        rounds[max(floor, job.round_id)] = MemberIds(
            list(rounds.get(max(floor, job.round_id), ())) + sorted(adopted))
    return dataclasses.replace(job, round_id=max(floor, job.round_id), rounds=rounds)


class Adoption:
    """Which workers were adopted, and which wait for the window to pass."""

    def __init__(self, window_s=ADOPTION_WINDOW_S):
        self.window_s = window_s
        self.first_at = None
        self.waiting = set()          # adopted, not yet seen registered
        self.held = set()             # adopted and registered: released with the window
        self.count = 0
        self.pending = []             # handed over by the hub, host not discovered yet
        self.floor = 0                # the newest round --state-dir remembers

    def take(self, backend, workers, job, now, hosts):
        """New records for the workers ``backend`` (the agent hub) hands over, once
        ``hosts`` (discovered: host -> slots) lists their host, and the job with its next
        worker id past theirs. Before that the policy would stop them as unwanted."""
        self.pending += backend.take_adopted() if hasattr(backend, "take_adopted") else []
        records, by_host, later = [], {}, []
        ended = [wid for wid, _, handle in self.pending if handle is None]
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

    def release(self, found, now, job, control, workers):
        """Of the workers ``found`` registered: those the driver may count as ready now
        (adopted ones once the window passed), and the job with its round floor."""
        self.held &= set(workers)           # one that exited meanwhile is not held
        self.waiting &= set(workers)
        found = set(found) & set(workers)
        adopted = found & self.waiting
        self.waiting -= adopted
        self.held |= adopted
        ready = found - self.held            # a held one found again (a full look) waits too
        if self.held and window_over(self.first_at, now, self.window_s):
            keys = [Keys.ready(w) for w in self.held] + [Keys.heartbeat(w) for w in self.held]
            try:
                values = list(control.get_many(keys).values())
            except ControlError:
                values = []
            job = with_floor(job, round_floor(values, max(job.round_id, self.floor)), self.held)
            ready |= self.held
            log.info("%d adopted worker(s) are back; the next round is %d", len(self.held),
                     job.round_id + 1)
            self.held = set()
        return ready, job
