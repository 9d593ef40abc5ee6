"""What the driver tells people: an event log (JSON lines) and one console line per change.

Round lines wait briefly for rank 0 to report how long training paused, so a
change reads as a single line: `round 4: 6 workers (+2 on node-3), training paused 0.41 s`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from elastic.protocol import Keys

if TYPE_CHECKING:
    from elastic.control_store import ControlStore
    from elastic.messages import Member

Listener = Callable[[str, dict[str, Any]], None]   # (event, fields)

log = logging.getLogger("elasticrun")
PAUSE_WAIT_S = 30.0
PROGRESS_EVERY_S = 10.0


class EventLog:
    """Appends one JSON object per line (without a path, none), and hands each event to
    its listeners (the live view, metrics and TensorBoard: runner/watch.py)."""

    def __init__(self, path: str | None = None) -> None:
        self._file = open(path, "a", buffering=1) if path else None
        self._lock = threading.Lock()
        self.listeners: list[Listener] = []

    def emit(self, event: str, **fields: Any) -> None:
        for listener in self.listeners:
            listener(event, fields)
        if self._file is None:
            return
        record = {"time": round(time.time(), 4), "event": event}
        record.update(fields)
        with self._lock:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class RoundReporter:
    """Console round lines with pause durations, and the live progress line."""

    def __init__(self, events: EventLog, control: ControlStore,
                 start_warning: str | None = None) -> None:
        self.events = events
        self.control = control
        self._start_warning = start_warning   # once the job runs: bad input stays one line
        self._pending: tuple[int, str, float] | None = None   # (round, line, published_at)
        self._progress_wid: str | None = None
        self._last_progress: tuple[Any, float] | None = None    # (step, at)
        self._last_print = 0.0
        self._last_seen_at: Any = None
        self._stragglers: dict[str, str] = {}   # worker id -> its figure, for the progress line

    def notice(self, line: str, event: str, fields: Mapping[str, Any]) -> None:
        """A warning worth an event (decisions.Notice); a straggler's figure also goes on
        the progress line while its round lasts."""
        log.warning("%s", line)
        self.events.emit(event, **fields)
        if event == "straggler":
            self._stragglers[fields["worker"]] = f"worker {fields['worker']} on " \
                                                 f"{fields['host']} {fields['ratio']:.1f}x"

    def round_started(self, round_id: int, members: Sequence[Member], change: str,
                      now: float) -> None:
        self.flush()
        self.events.emit("round_started", round=round_id, size=len(members), change=change,
                         members=[{"worker_id": m.worker_id, "host": m.host, "rank": m.rank}
                                  for m in members])
        line = f"round {round_id}: {len(members)} workers ({change or 'the same members again'})"
        self._progress_wid = members[0].worker_id if members else None
        ids = {m.worker_id for m in members}
        self._stragglers = {w: f for w, f in self._stragglers.items() if w in ids}
        self._last_progress = None
        if round_id == 1:
            log.info(line)
            if self._start_warning:
                log.warning("%s", self._start_warning)
                self._start_warning = None
        else:
            self._pending = (round_id, line, now)

    def flush(self, pause: float | None = None) -> None:
        if self._pending is None:
            return
        round_id, line, _ = self._pending
        self._pending = None
        if pause is None:
            log.info(line)
        else:
            log.info("%s, training paused %.2f s", line, pause)
            self.events.emit("pause", round=round_id, seconds=pause)

    def poll(self, now: float) -> None:
        if self._pending is not None:
            round_id, _, published = self._pending
            value = self.control.get(Keys.pause(round_id))
            if value is not None:
                self.flush(float(value["seconds"]))
            elif now - published > PAUSE_WAIT_S:
                self.flush()
        self._poll_progress(now)

    def _poll_progress(self, now: float) -> None:
        """Every new report goes to the event log; the console gets a line every 10 s."""
        if self._progress_wid is None:
            return
        value = self.control.get(Keys.progress(self._progress_wid))
        if value is None or "step" not in value or value.get("at") == self._last_seen_at:
            return
        self._last_seen_at = value.get("at")
        step = value["step"]
        last = self._last_progress
        extra = {k: v for k, v in value.items() if k not in ("at", "round")}
        if last is None or step < last[0]:
            self._last_progress = (step, now)
            self._last_print = now
            self.events.emit("progress", rate=None, **extra)
            return
        rate = (step - last[0]) / (now - last[1]) if now > last[1] else 0.0
        self.events.emit("progress", rate=round(rate, 3), **extra)
        if now - self._last_print < PROGRESS_EVERY_S or step == last[0]:
            return
        self._last_print = now
        self._last_progress = (step, now)
        slow = "; straggler: " + ", ".join(self._stragglers.values()) if self._stragglers else ""
        log.info("progress: step %s, %.1f steps/s%s", step, rate, slow)
