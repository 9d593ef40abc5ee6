"""Line plumbing shared by the driver, the agent and the launch client (standard library only).

``pump_output`` moves a child's output in bounded chunks: a line longer than
``MAX_LINE_BYTES`` is cut and marked, and ``\\r`` progress updates (tqdm bars)
are forwarded at most once per ``PROGRESS_INTERVAL_S``, so whatever a worker
writes, the reader holds at most one chunk and one line of it.
``read_json_lines`` reads JSON-lines files such as the event log.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from typing import IO, Any

MAX_LINE_BYTES = 16 * 1024         # longer lines are cut here and marked
READ_CHUNK_BYTES = 64 * 1024       # one read of a child's pipe
PROGRESS_INTERVAL_S = 1.0          # at most one \r update per stream per interval
CUT_MARK = " [elastic: line cut at {limit} bytes]"

_BREAK = re.compile(rb"\r\n|\n|\r")


class LineSplitter:
    """Bytes in, ``(line, is_progress)`` out; never holds more than one line.

    ``\\n`` and ``\\r\\n`` end a line; a lone ``\\r`` ends a progress update (the
    text a terminal would overwrite). Past ``max_line`` bytes a line is emitted
    at once, cut and marked, and the rest of it, up to its end, is dropped.
    """

    def __init__(self, max_line: int = MAX_LINE_BYTES):
        self.max_line = max_line
        self._buf = bytearray()
        self._carry = b""          # a trailing \r: is it \r\n? the next chunk says
        self._cutting = False      # the current line was emitted cut; drop the rest

    def feed(self, chunk: bytes) -> list[tuple[bytes, bool]]:
        data = self._carry + chunk
        self._carry = b""
        if data.endswith(b"\r"):
            data, self._carry = data[:-1], b"\r"
        out: list[tuple[bytes, bool]] = []
        pos = 0
        for match in _BREAK.finditer(data):
            self._add(data[pos:match.start()], out)
            self._end(match.group() == b"\r", out)
            pos = match.end()
        self._add(data[pos:], out)
        return out

    def finish(self) -> list[tuple[bytes, bool]]:
        """What is left at end of file: a last line without its newline."""
        out: list[tuple[bytes, bool]] = []
        if self._carry or self._buf:
            self._end(bool(self._carry), out)
        self._carry = b""
        self._cutting = False
        return out

    def _add(self, piece: bytes, out: list) -> None:
        if self._cutting or not piece:
            return
        room = self.max_line - len(self._buf)
        if len(piece) <= room:
            self._buf += piece
            return
        self._buf += piece[:room]
        out.append((bytes(self._buf) + CUT_MARK.format(limit=self.max_line).encode(), False))
        self._buf.clear()
        self._cutting = True

    def _end(self, progress: bool, out: list) -> None:
        if self._cutting:
            self._cutting = False
        elif self._buf or not progress:
            out.append((bytes(self._buf), progress))
        self._buf.clear()


def pump_output(stream: IO[bytes], on_line: Callable[[bytes], None], *,
                on_chunk: Callable[[bytes], None] | None = None,
                max_line: int = MAX_LINE_BYTES,
                progress_interval: float = PROGRESS_INTERVAL_S) -> None:
    """Hand each line of ``stream`` (without its line break) to ``on_line`` until
    end of file, then close it. ``on_chunk`` gets the raw bytes as read (for a
    log file that keeps everything). Progress updates between two forwarded ones
    are dropped, except the last one before end of file."""
    splitter = LineSplitter(max_line)
    read = getattr(stream, "read1", None) or stream.read
    pending = None
    last_progress = None
    try:
        while True:
            chunk = read(READ_CHUNK_BYTES)
            if not chunk:
                break
            if on_chunk is not None:
                on_chunk(chunk)
            for line, progress in splitter.feed(chunk):
                if not progress:
                    pending = None
                    on_line(line)
                    continue
                now = time.monotonic()
                if last_progress is None or now - last_progress >= progress_interval:
                    last_progress, pending = now, None
                    on_line(line)
                else:
                    pending = line
        for line, _progress in splitter.finish():
            pending = None          # the newest text there is
            on_line(line)
        if pending is not None:
            on_line(pending)
    finally:
        stream.close()


def read_json_lines(path: str | os.PathLike, strict: bool = False) -> list[Any]:
    """The JSON values of a JSON-lines file; blank lines are skipped.

    ``strict``: a line that is not JSON raises ValueError naming it; otherwise it
    is skipped (a log cut short by a kill ends in half a line). OSError propagates.
    """
    values = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                values.append(json.loads(line))
            except ValueError:
                if strict:
                    raise ValueError(f"{path}: line {number} is not JSON") from None
    return values
