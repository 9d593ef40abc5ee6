"""What a worker tells the driver about itself: heartbeats that carry progress.

A heartbeat alone proves that the process lives, not that it trains: a stuck
data loader or a deadlock in C++ stops the training thread while the
heartbeat thread keeps beating. So every beat also carries the training
thread's progress (completed waits and commits) and what it waits in right
now, which lets the driver tell a rank that its peers wait on from one that
waits itself (DESIGN §4, "No hangs").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from elastic.protocol import RECONNECT_WITHIN_S, Keys, driver_refuses
from elastic.worker.driver_contact import port_accepts

if TYPE_CHECKING:
    from elastic.protocol import ControlStore
    from elastic.worker.driver_contact import DriverContact

log = logging.getLogger(__name__)


class Progress:
    """Counters the training thread bumps; the heartbeat thread reads them.

    Each field is replaced by one assignment, so a reader on another thread
    sees either the old or the new value, never half of one.
    """

    def __init__(self) -> None:
        self.waits = 0          # completed collectives, group set-ups, round assemblies
        self.issued = 0         # collectives started (DistributedOptimizer's hooks in backward)
        self.commits = 0
        self.holds = -1         # the commit the state holds (-1 before its first sync)
        self.durable = -1       # the newest checkpoint written or resumed from
        self.waited_s = 0.0     # seconds waited on peers so far (stragglers, driver side)
        # (what, round id, on peers, start) while the thread waits
        self._waiting: tuple[str, int, bool, float] | None = None
        self.seconds: dict[str, float] = {}       # "commit"/"sync" -> how long the last one took (elasticctl)

    def begin_wait(self, what: str, round_id: int, on_peers: bool = True) -> None:
        """``on_peers``: False for waits on the driver (for a round to be published)."""
        self._waiting = (what, int(round_id), on_peers, time.monotonic())

    def end_wait(self) -> None:
        waiting, self._waiting = self._waiting, None
        if waiting is not None and waiting[2]:
            self.waited_s += time.monotonic() - waiting[3]
        self.waits += 1

    def committed(self) -> None:
        self.commits += 1

    def issue(self) -> None:
        self.issued += 1

    def timed(self, what: str, seconds: float) -> None:
        self.seconds = {**self.seconds, what: round(seconds, 6)}

    def report(self) -> dict[str, Any]:
        waiting = self._waiting
        value: dict[str, Any] = {"waits": self.waits + self.issued, "commits": self.commits, "waiting": None,
                 "seconds": self.seconds, "holds": self.holds, "durable": self.durable}
        waited = self.waited_s
        if waiting is not None:
            what, round_id, on_peers, since = waiting
            waited += time.monotonic() - since if on_peers else 0.0
            value["waiting"] = {"what": what, "round": round_id, "on_peers": on_peers,
                                "seconds": round(time.monotonic() - since, 3)}
        value["waited"] = round(waited, 3)
        return value


# A connect to a live driver can stall for seconds when thousands connect at once; a
# dead driver refuses at once, so a generous timeout does not slow orphan detection.
CONNECT_TIMEOUT_S = 15.0
DRIVER_GONE_REFUSALS = 3     # failed beats while the driver's port refuses connections


@dataclass(frozen=True)
class BeatLink:
    """What the heartbeat reads and calls, and nothing more of the worker.

    ``connect()`` opens a new control connection for the beats (the driver's port
    was just seen to accept); ``status()`` is what a beat carries besides its
    number (progress, round, latest round, leaving: what an adopting driver reads);
    ``leave_requested()`` the SIGTERM's number, 0 before one."""

    worker_id: str
    driver_at: tuple[str, int]
    contact: DriverContact
    connect: Callable[[], ControlStore]
    status: Callable[[], dict[str, Any]]
    leave_requested: Callable[[], int]
    leaving: LeavingReport


class Heartbeat(threading.Thread):
    """Puts a signed beat (count + progress) on its own store connection; exits the
    process when the driver is gone.

    A SIGSTOPped worker stops beating too, which is how the driver tells a hung
    worker from a slow one. ``wake()`` sends a beat at once (a SIGTERM to leave).
    """

    def __init__(self, link: BeatLink, interval: float):
        super().__init__(name="elastic-heartbeat", daemon=True)
        self._link = link
        self._interval = interval
        self._halt = threading.Event()    # not _stop: Thread's own, which a fork calls
        self._wake = threading.Event()
        self._conn: ControlStore | None = None
        self._beat = 0

    def first_beat(self) -> None:
        """Connect and beat once before the worker registers: the driver's heartbeat
        deadline runs from the moment it sees the worker ready."""
        try:
            self._beat += 1
            self.send(self._beat)
            self._link.contact.refresh()     # training reads its news on that one
        except Exception:  # noqa: BLE001 - the thread retries (and gives up) as usual
            self._conn = None

    def run(self) -> None:
        refusals, lost_since = 0, None
        link = self._link
        contact = link.contact
        while not self._halt.is_set():
            try:
                self._beat += 1
                self.send(self._beat)
                refusals, lost_since = 0, None
                if contact.away:
                    # A put may "succeed" on a dead socket; a read needs the driver's answer.
                    conn = self._connection()       # the one send() just used
                    conn.fetch(Keys.heartbeat(link.worker_id))
                    contact.back()
                    contact.announce(conn)          # a restarted driver adopts us from it
                contact.refresh()                   # never opened on the training thread
            except Exception:  # noqa: BLE001 - any store failure means the driver may be gone
                self._conn = None
                now = time.monotonic()
                lost_since = now if lost_since is None else lost_since
                if contact.patient:
                    contact.lost()       # joining mode: the agent decides how long we wait
                else:
                    refusals = refusals + 1 if driver_refuses(*link.driver_at) else 0
                # A closed port is a driver that is gone; silence may be the network,
                # which gets as long as the store connections do (RECONNECT_WITHIN_S).
                if not contact.patient and not self._halt.is_set() and \
                        (refusals >= DRIVER_GONE_REFUSALS or now - lost_since >= RECONNECT_WITHIN_S):
                    log.error("lost contact with elasticrun; exiting so no orphan is left behind")
                    os._exit(1)
            self._wake.wait(self._interval)
            self._wake.clear()

    def send(self, beat: int) -> None:
        link = self._link
        conn = self._connection()
        value = dict(link.status(), beat=beat)
        if link.leave_requested():
            link.leaving.put(conn)
        conn.put(Keys.heartbeat(link.worker_id), value)

    def _connection(self) -> ControlStore:
        """The beats' connection, made now if there is none."""
        link = self._link
        if self._conn is None:
            if link.contact.patient and not port_accepts(*link.driver_at):
                raise ConnectionRefusedError("the driver is away")   # no store client noise
            self._conn = link.connect()
        return self._conn

    def wake(self) -> None:
        self._wake.set()

    def store_stats(self) -> tuple[int, int]:
        """(requests, bytes read) on the heartbeat's own connection (its latest one)."""
        conn = self._conn
        return (conn.requests, conn.bytes_read) if conn is not None else (0, 0)

    def stop(self) -> None:
        self._halt.set()
        self._wake.set()


class LeavingReport:
    """Keys.leaving, written by the heartbeat (at once, on SIGTERM) and by the training
    thread (with the commit it left at): one lock, and once a commit is named every
    later write names it too, so the driver's "left at commit N" keeps its number.
    ``signal()`` is the SIGTERM's number."""

    def __init__(self, worker_id: str, signal: Callable[[], int]):
        self._worker_id = worker_id
        self._signal = signal
        self._lock = threading.Lock()
        self._commit: int | None = None

    def put(self, conn: ControlStore | None, commit: int | None = None) -> None:
        """Remember ``commit`` and put the report on ``conn`` (None: the driver is away;
        the heartbeat puts it once the driver is back)."""
        with self._lock:
            if commit is not None:
                self._commit = commit
            if conn is None:
                return
            conn.put(Keys.leaving(self._worker_id), {"signal": self._signal(),
                                                     "commit": self._commit})
