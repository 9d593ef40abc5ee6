"""Line plumbing shared by the driver and the launch client (standard library only).

``pump_lines`` moves a child's output a line at a time; ``read_json_lines``
reads JSON-lines files such as the event log.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import IO, Any


def pump_lines(stream: IO[bytes], on_line: Callable[[bytes], None]) -> None:
    """Hand each line of ``stream`` to ``on_line`` until end of file, then close it."""
    try:
        for raw in iter(stream.readline, b""):
            on_line(raw)
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
