"""What an agent sends its driver: its workers' output lines and exits, in order, bounded.

A line longer than MAX_LINE_CHARS reaches the driver cut and marked; while the driver
reads too slowly, at most MAX_QUEUED_LINES wait and the rest are dropped and counted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import IO

from elastic import streams
from elastic.runner import launcher

MAX_REPORT_LINES = 2000
MAX_LINE_CHARS = 8192           # a longer line reaches the driver cut and marked (bytes, as read)
MAX_QUEUED_LINES = 10 * MAX_REPORT_LINES   # beyond this, lines wait in no queue: dropped, counted


class ForwardingSink(launcher.OutputSink):
    """Prints and keeps worker output locally and queues each line for the driver."""

    def __init__(self, output_dir: str | None, outbox: Outbox, quiet: bool = False) -> None:
        super().__init__(output_dir, quiet=quiet, max_line=MAX_LINE_CHARS)
        self._outbox = outbox

    def attach(self, worker_id: str, stream: IO[bytes], name: str,
               on_line: Callable[[bytes], None] | None = None) -> threading.Thread:
        def forward(raw: bytes) -> None:
            self._outbox.line(worker_id, name, raw)
        return super().attach(worker_id, stream, name, on_line=forward)


class Outbox:
    """Output lines and exits waiting to go to the driver, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._out: list[list[str]] = []          # [worker id, stream, text]
        self._exits: list[list[str | int]] = []  # [worker id, exit code]
        # (worker_id, stream) -> lines dropped while the queue was full
        self._dropped: dict[tuple[str, str], int] = {}

    def line(self, worker_id: str, name: str, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace")
        if len(text) > MAX_LINE_CHARS:
            text = text[:MAX_LINE_CHARS] + streams.CUT_MARK.format(limit=MAX_LINE_CHARS)
        with self._lock:
            if len(self._out) >= MAX_QUEUED_LINES:
                key = (worker_id, name)
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return
            self._tell_dropped()
            self._out.append([worker_id, name, text])

    def _tell_dropped(self) -> None:
        """One line per stream that lost lines to a full queue (the lock is held)."""
        for (wid, stream), count in self._dropped.items():
            self._out.append([wid, stream, f"[elastic: {count} lines dropped: the driver "
                                           "did not read them fast enough]"])
        self._dropped.clear()

    def exited(self, worker_id: str, code: int) -> None:
        with self._lock:
            self._exits.append([worker_id, code])

    def take(self) -> tuple[list[list[str]], list[list[str | int]]]:
        with self._lock:
            if self._dropped and len(self._out) < MAX_QUEUED_LINES:
                self._tell_dropped()
            out, self._out = self._out[:MAX_REPORT_LINES], self._out[MAX_REPORT_LINES:]
            exits, self._exits = (self._exits, []) if not self._out else ([], self._exits)
        return out, exits
