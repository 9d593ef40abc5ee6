"""The driver's side of the control store: where it listens, what it reads, and
keeping its own values in place (elastic/auth.py says why values are sealed)."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from elastic import protocol as control
from elastic.protocol import ControlStore, Keys
from elastic.runner import binding

if TYPE_CHECKING:
    from elastic.messages import Member

log = logging.getLogger("elasticrun")
HEALED_PER_S = 2048       # the driver's heals slow down when many values are kept
FULL_LOOK_S = 2.0         # every awaited key is looked at this often (a doorbell may be wiped)
ROUND_KEYS_KEPT = 8       # rounds whose keys stay in the store; older ones are deleted
ASSEMBLED_KEPT = 3        # the assembly outcome of this many recent rounds is kept in place
ERRORS_EVERY_S = 0.25     # a failed round's reports are read again at most this often


class Janitor(threading.Thread):
    """Deletes keys nobody reads any more (old rounds, reaped workers) on its own
    connection, so a long job's store does not grow with every round and the event
    loop never waits on thousands of deletes."""

    def __init__(self, address: str, port: int, secret: bytes | str) -> None:
        super().__init__(daemon=True, name="elastic-janitor")
        self._address, self._port, self._secret = address, port, secret
        self._queue: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()
        self.deleted = 0
        self.start()

    def drop(self, keys: Iterable[str]) -> None:
        self._queue.put(list(keys))

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the deletes asked for so far. A thread still inside a store
        call when the interpreter exits would abort the process (std::terminate)."""
        self._queue.put(None)
        self.join(timeout)

    def run(self) -> None:
        try:
            store = ControlStore(control.open_link(self._address, self._port, 30), self._secret)
            while True:
                keys = self._queue.get()
                if keys is None:
                    return
                for key in keys:
                    store.delete(key)
                    self.deleted += 1
        except Exception:  # noqa: BLE001 - the store went away with the driver
            return


class DriverControl:
    """One store, bound only where the job needs it (binding.py)."""

    def __init__(self, hosts: Iterable[str], names: Collection[str] | None, secret: bytes | str,
                 network_interface: str | None = None, serving: bool = False,
                 port: int = 0) -> None:
        """OSError / RuntimeError: the store cannot listen."""
        self.binding = binding.choose(hosts, names, network_interface, serving=serving)
        self._server = control.listen(self.binding.address, 30, port=port)
        self.port = self._server.port
        # The server's own client connection never reconnects: talk over one that does.
        self._link = control.open_link(self.binding.local_connect_address(), self.port, 30,
                                       warn=log.warning)
        self.store = ControlStore(self._link, secret, warn=log.warning)
        # stores sealed with other keys (elasticctl's): healed too
        self._other_keys: list[ControlStore] = []
        self._names = names
        self._healed_at = 0.0
        self._unreachable_warned: set[str] = set()
        self._announced = False
        # round id -> (member ids not arrived yet, all member ids)
        self._assembling: dict[int, tuple[set[str], list[str]]] = {}
        # (round id, member ids, reaped) of recent rounds
        self._history: collections.deque[tuple[int, list[str], list[str]]] = collections.deque()
        self._reaped: list[str] = []          # workers reaped since the last publish
        self._registered = control.Doorbell(self.store, Keys.REGISTERED)
        self._bells: dict[int, control.Doorbell] = {}   # round id -> Doorbell of its arrivals
        self._full_looks: dict[Any, float] = {}      # what was last looked at in full, and when
        # round id -> (when, its failure reports) last read
        self._errors: dict[int, tuple[float, dict[str, str]]] = {}
        self._janitor = Janitor(self.binding.local_connect_address(), self.port, secret)

    def sealed_with(self, secret: bytes | str) -> ControlStore:
        """Values sealed with another key than the workers' (elasticctl's,
        protocol.ctl_key), in that key's namespace, over the same connection."""
        store = ControlStore(self._link, secret, warn=log.warning)
        self._other_keys.append(store)
        return store

    def close(self) -> None:
        """Stop the janitor; the store itself goes with the process."""
        self._janitor.close()

    def describe(self) -> str:
        return f"control store listening on {self.binding.address}:{self.port} " \
               f"({self.binding.reason})"

    def announce(self) -> None:
        """Log where the store listens, once (not before workers need it: a job that
        fails before starting any keeps its one error line)."""
        if not self._announced:
            self._announced = True
            log.info("%s", self.describe())

    def heal(self, now: float) -> None:
        """Rounds, plans and aborts an outsider destroyed are back within
        protocol.HEAL_EVERY_S (2 s while the 4,096 entries of a big round's members who
        have not arrived are kept too: each heal reads every kept value back)."""
        if now - self._healed_at >= max(control.HEAL_EVERY_S, self.store.kept / HEALED_PER_S):
            self._healed_at = now
            for store in (self.store, *self._other_keys):
                store.heal()

    def heartbeats(self, worker_ids: Sequence[str]) -> dict[str, int | None]:
        """{worker id: its latest sealed beat number, or None (forged, replayed, none yet)}."""
        values = self.store.get_many(Keys.heartbeat(w) for w in worker_ids)
        return {w: (int(v["beat"]) if v is not None else None)
                for w, v in ((w, values[Keys.heartbeat(w)]) for w in worker_ids)}

    def heartbeat_values(self, worker_ids: Sequence[str]) -> dict[str, Any]:
        """{worker id: its latest sealed beat (beat number and the training thread's
        progress, liveness.py), or None (forged, replayed, none yet)}."""
        values = self.store.get_many(Keys.heartbeat(w) for w in worker_ids)
        return {w: values[Keys.heartbeat(w)] for w in worker_ids}

    # -- rounds -------------------------------------------------------------------------
    def publish(self, round_id: int, members: Sequence[Member]) -> None:
        """Each member's entry first, then the header, then the latest round: a worker
        that sees the header finds its own entry there. Each is kept until its member
        arrives (it has read its entry then) or the round is over. An entry carries the
        round's size (planner.plan_round), so a member of a big round reads only it."""
        self.store.put_many({Keys.member(round_id, m.worker_id): m.to_json() for m in members},
                            keep=True)
        ids = [m.worker_id for m in members]
        plan = control.RoundPlan.of(round_id, ids)
        self.store.put(Keys.plan(round_id), plan.to_json(), keep=True)
        self.store.put(Keys.LATEST_ROUND, {"round": round_id}, keep=True)
        for old in list(self._assembling):
            self._settle(old, False)       # replaced (the driver aborted it already)
        self._assembling[round_id] = (set(ids), ids)
        self._full_looks[("arrivals", round_id)] = time.monotonic()   # the bell comes first
        self._history.append((round_id, ids, self._reaped))
        self._reaped = []
        while len(self._history) > ROUND_KEYS_KEPT:
            old_round, old_ids, reaped = self._history.popleft()
            self._janitor.drop(self._round_keys(old_round, old_ids))
            for wid in reaped:          # gone for ROUND_KEYS_KEPT rounds: nobody reads them
                self._janitor.drop([Keys.ready(wid), Keys.heartbeat(wid), Keys.done(wid),
                                    Keys.progress(wid), Keys.leaving(wid)])
        self.store.forget(Keys.plan(round_id - 1))
        self.store.forget(Keys.assembled(round_id - ASSEMBLED_KEPT))

    def assembly(self, round_id: int, now: float | None = None) -> int | None:
        """How many members of ``round_id`` have arrived; reads only the arrivals rung
        since the last look (every awaited one every FULL_LOOK_S), and says
        ``assembled`` on the round's key once all are in."""
        entry = self._assembling.get(round_id)
        if entry is None:
            return None                     # assembled (or replaced) already
        pending, ids = entry
        bell = self._bells.setdefault(round_id, control.Doorbell(self.store,
                                                                  Keys.arrivals(round_id)))
        for wid in self._verified(bell, pending, lambda w: Keys.joined(round_id, w),
                                  ("arrivals", round_id), now):
            pending.discard(wid)
            self.store.forget(Keys.member(round_id, wid))    # it read its entry
        if pending:
            return len(ids) - len(pending)
        self._settle(round_id, True)
        return len(ids)

    def abort(self, round_id: int) -> None:
        self.store.put(Keys.abort(round_id), {"round": round_id}, keep=True)
        if round_id in self._assembling:
            self._settle(round_id, False)   # members waiting to assemble give up at once

    def _settle(self, round_id: int, ok: bool) -> None:
        _, ids = self._assembling.pop(round_id)
        self._bells.pop(round_id, None)
        self._full_looks.pop(("arrivals", round_id), None)
        self.store.put(Keys.assembled(round_id), control.Assembled(round_id, ok).to_json(), keep=True)
        for wid in ids:
            self.store.forget(Keys.member(round_id, wid))

    @staticmethod
    def _round_keys(round_id: int, ids: Iterable[str]) -> list[str]:
        keys = [Keys.plan(round_id), Keys.assembled(round_id), Keys.abort(round_id),
                Keys.arrivals(round_id),
                Keys.failures(round_id), Keys.pause(round_id)]
        for wid in ids:
            keys += [Keys.member(round_id, wid), Keys.joined(round_id, wid),
                     Keys.failed(round_id, wid)]
        return keys

    def worker_gone(self, worker_id: str) -> None:
        """A worker's process exited and was reaped: its own keys go with the keys of
        the round published next (the progress line may still read them until then;
        a key deleted between a check and a read would stall that read)."""
        self._reaped.append(worker_id)

    def ready(self, worker_ids: Iterable[str], now: float | None = None) -> set[str]:
        """Those of ``worker_ids`` whose sealed registration is in the store (looking
        at the ones that rang, and at all of them every FULL_LOOK_S)."""
        found = self._verified(self._registered, set(worker_ids), Keys.ready, "ready", now)
        if found:      # their connections are accepted by now: keepalive on the driver's side
            control.keepalive_on_accepted(self.port)
        return found

    def _verified(self, bell: control.Doorbell, awaited: Collection[str],
                  key_of: Callable[[str], str], look: Hashable, now: float | None) -> set[str]:
        """The awaited names whose sealed key holds a value. Every awaited key is looked
        at once the doorbell has brought no verified name for FULL_LOOK_S (it may have
        been wiped): while names stream in, such a look (thousands of reads in a big
        round) would only slow the stream down."""
        now = time.monotonic() if now is None else now
        names = [w for w in bell.new_names() if w in awaited]
        full = now - self._full_looks.get(look, 0.0) >= FULL_LOOK_S
        if full:
            names = list(awaited)
        keys = {key_of(w): w for w in dict.fromkeys(names)}
        found = {keys[k] for k in self.store.get_present(keys)}
        if found or full:
            self._full_looks[look] = now
        return found

    def failure_reports(self, round_id: int, member_ids: Sequence[str]) -> dict[str, str]:
        """{worker id: its error text} of the round's sealed failure reports ({}: none).
        The doorbell is looked at each time; the members' reports, once it rang, at most
        every ERRORS_EVERY_S (a big round's are many reads)."""
        doorbell = Keys.failures(round_id)
        if not self.store.present(doorbell):
            return {}
        now = time.monotonic()
        looked = self._errors.get(round_id)
        if looked is None or now - looked[0] >= ERRORS_EVERY_S:
            reports = self.store.get_many(Keys.failed(round_id, wid) for wid in member_ids)
            found = {w: str(v.get("error", "")) for w in member_ids
                     if (v := reports[Keys.failed(round_id, w)]) is not None}
            bell = self.store.get(doorbell) if not found else None
            if bell is not None:       # its report is not readable (yet): the bell speaks
                found = {str(bell.get("worker", "?")): ""}
            self._errors = {round_id: (now, found)}
            looked = self._errors[round_id]
        return looked[1]

    def rang(self, round_ids: Iterable[int]) -> tuple[int, ...]:
        """The rounds among ``round_ids`` whose failure doorbell rang: one read each."""
        return tuple(r for r in round_ids if self.store.present(Keys.failures(r)))

    def remote_address(self, host: str) -> str | None:
        """The store address for workers on remote ``host`` (None: per host), warning
        once when the store listens where that host cannot reach it."""
        if not self.binding.reaches(host, self._names) and host not in self._unreachable_warned:
            self._unreachable_warned.add(host)
            log.warning("host %s is not local but the control store listens on %s only (%s "
                        "at start): its workers cannot connect; restart with "
                        "--network-interface IF to admit remote hosts", host,
                        self.binding.address, self.binding.reason)
        return self.binding.remote_connect_address()
