"""Whether the driver answers, and reads that treat its absence as "no news".

In joining mode (an agent started this worker, ``ELASTIC_DRIVER_GRACE`` > 0) the
driver may vanish and come back (a restarted pod at the same address): the
worker is *patient*. Its agent, not the worker, decides when waiting has lasted
too long (docs/failure-model.md, "The driver is lost"). Meanwhile:

* the heartbeat marks the driver ``away`` at its first failed beat and ``back``
  at the next one that goes through;
* what training looks at between steps (a newer round, the stop, the round's
  abort) is read on a connection of its own that never waits for a reconnect,
  and reads as absent while the driver is away: training goes on in the
  current round until the round must change. Only the heartbeat thread opens
  that connection (``refresh``): a connect can take seconds (a dying driver's
  port still completes handshakes, then never answers), and on the training
  thread that stalled every rank (docs/benchmarks.md, "driver restart");
* once back, the heartbeat puts the worker's registration in the store again,
  with the rounds it knows, so a restarted driver can adopt it.

Outside joining mode the worker is not patient and nothing here changes how it
behaves: it dies with the driver (liveness.py), so no orphan is left.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from elastic import protocol as control
from elastic.protocol import ControlError, Keys

if TYPE_CHECKING:
    from elastic.protocol import ControlStore
    from elastic.worker.runtime import Worker

log = logging.getLogger(__name__)
NEWS_CONNECT_S = 5.0


def driver_grace(environ: Mapping[str, str] | None = None) -> float:
    """The agent's --driver-grace in seconds (0: not patient, die with the driver)."""
    env = os.environ if environ is None else environ
    try:
        return max(0.0, float(env.get(control.ENV_DRIVER_GRACE, "0")))
    except ValueError:
        return 0.0


class DriverContact:
    """The worker's view of whether its driver answers (set by the heartbeat)."""

    def __init__(self, worker: Worker, grace_s: float) -> None:
        self._worker = worker
        self.grace_s = float(grace_s)
        self.patient = self.grace_s > 0
        self._lock = threading.Lock()
        self.away_since: float | None = None   # monotonic time of the first failed beat, or None
        self.returns = 0              # how often the driver came back (tests read it)
        self._news: ControlStore | None = None   # the fast-failing ControlStore for no-news reads

    @property
    def away(self) -> bool:
        return self.away_since is not None

    def reconnect_window(self, default: float) -> float:
        """How long one store call may keep reconnecting: a patient worker's calls that
        need the driver wait for it as long as its agent keeps the worker."""
        return max(default, self.grace_s + 30.0) if self.patient else default

    def lost(self) -> None:
        with self._lock:
            if self.away_since is None:
                self.away_since = time.monotonic()
                log.warning("the driver does not answer; training goes on in round %d and "
                            "waits for it only when the round must change",
                            self._worker.round_id)

    def back(self) -> bool:
        """A beat went through again: re-announce this worker (a restarted driver knows
        nothing of it) and let the no-news reads look again."""
        with self._lock:
            was_away, self.away_since = self.away_since is not None, None
        if was_away:
            self.returns += 1
            log.warning("the control store answers again")
        return was_away

    def announce(self, conn: ControlStore) -> None:
        """Our registration (sealed, on ``conn``) with the newest rounds we know: what a
        restarted driver adopts us from (runner/adoption.py)."""
        w = self._worker
        if not w.registered:
            return
        value = {"pid": os.getpid(), "round": w.round_id, "latest": w.known_latest,
                 "rank": w.membership.rank if w.membership is not None else None,
                 "adopt": True}
        w.control.rekeep(Keys.ready(w.worker_id), value)   # a newcomer heals its registration
        conn.put(Keys.ready(w.worker_id), value)
        control.Doorbell(conn, Keys.REGISTERED).ring(w.worker_id)

    def news(self, key: str) -> Any:
        """The verified value of ``key``; None when absent, forged, or (patient) when the
        driver does not answer. Raises ControlError only where the plain read would."""
        if not self.patient:
            return self._worker.control.get(key)
        conn = self._news
        if conn is None:
            return None                   # the heartbeat thread connects again
        try:
            return conn.get(key)
        except ControlError:
            raise
        except Exception:  # noqa: BLE001 - an unreachable driver is no news
            self._drop(conn)
            return None

    def quiet_connection(self) -> ControlStore | None:
        """A connection for a report the driver may miss (None while it is away): the
        training thread never waits on a reconnect for it."""
        return self._news if self.patient else self._worker.control

    def put_news(self, key: str, value: Any) -> None:
        """Put a report the driver may miss: while it is away (patient), it is dropped."""
        if not self.patient:
            self._worker.control.put(key, value)
            return
        conn = self._news
        try:
            if conn is not None:
                conn.put(key, value)
        except Exception:  # noqa: BLE001 - the driver is gone: nobody to tell
            self._drop(conn)

    def refresh(self) -> None:
        """On the heartbeat thread (patient only): open the no-news connection when there
        is none and the driver's port accepts. It may block for NEWS_CONNECT_S; the
        training thread only ever uses a connection that is already open."""
        if not self.patient or self._news is not None or \
                not port_accepts(*self._worker.driver_at):
            return
        try:
            self._news = self._worker.new_control_connection(timeout=NEWS_CONNECT_S,
                                                             reconnect_within_s=0)
        except Exception:  # noqa: BLE001 - not there (yet): the next beat tries again
            pass

    def _drop(self, conn: ControlStore | None) -> None:
        if self._news is conn:            # the heartbeat may have opened a new one already
            self._news = None
        self.lost()


def port_accepts(host: str, port: int | str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts connections at host:port (a dead driver: at once, no)."""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False
