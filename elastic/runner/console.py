"""What the user sees of a job: worker output, and the root cause when it fails.

``Console`` is the driver's output sink (``launcher.OutputSink``) that also
remembers the job's first failure: which worker, its rank and host, when, and
the tail of its traceback, read from the worker's error file
(``elastic/worker/error_file.py``) or, when that file is not on this machine,
from the last lines of its stderr. When the job fails, ``root_cause`` gives the
block the driver prints before its one error line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic.runner.launcher import OutputSink

if TYPE_CHECKING:
    from elastic.messages import Member

log = logging.getLogger("elasticrun")
TRACEBACK_TAIL_LINES = 15
ERROR_FILE = "error.json"          # as elastic/worker/error_file.py writes it


@dataclass
class Failure:
    worker_id: str
    host: str
    rank: int | None               # None when it never joined a round
    at: float                      # time.time()
    reason: str                    # the driver's line, e.g. "... exited with code 1"
    details: list[str]             # traceback tail (or stderr tail) lines
    error_file: str | None = None  # its path when kept (under --output-filename)
    source: str = "stderr"         # "error file" or "stderr"


def read_error_file(path: str) -> dict[str, Any] | None:
    """The worker's error record, or None when absent or unreadable."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def stamp(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


class Console(OutputSink):
    """The driver's sink: worker lines out, the first failure kept."""

    def __init__(self, output_dir: str | None = None, quiet: bool = False,
                 timestamps: bool = False, ranks: Iterable[int] | None = None,
                 error_dir: str | None = None, keep_error_files: bool = False) -> None:
        super().__init__(output_dir, quiet=quiet, timestamps=timestamps, ranks=ranks)
        self.error_dir = error_dir
        self.keep_error_files = keep_error_files
        self.first: Failure | None = None
        self.failures = 0
        self._round_rank: dict[str, int] = {}

    def set_ranks(self, members: Sequence[Member]) -> None:
        super().set_ranks(members)
        self._round_rank.update({m.worker_id: m.rank for m in members})

    def worker_failed(self, worker_id: str, host: str, reason: str) -> None:
        """A worker failed (its host is blamed); the first one is the root cause."""
        self.failures += 1
        if self.first is not None:
            return
        path = (os.path.join(self.error_dir, f"worker.{worker_id}", ERROR_FILE)
                if self.error_dir else None)
        record = read_error_file(path) if path else None
        if record is not None and str(record.get("worker")) == str(worker_id):
            details = str(record.get("traceback", "")).rstrip("\n").splitlines()
            rank = record.get("rank")
            at = record.get("time") if isinstance(record.get("time"), (int, float)) else None
            self.first = Failure(worker_id, host, rank, at or time.time(), reason,
                                 details[-TRACEBACK_TAIL_LINES:],
                                 path if self.keep_error_files else None, "error file")
        else:
            self.first = Failure(worker_id, host, self._round_rank.get(worker_id),
                                 time.time(), reason, self.tail(worker_id)[-10:])

    def root_cause(self) -> list[str]:
        """The lines of the root-cause block (empty when nothing failed)."""
        f = self.first
        if f is None:
            return []
        rank = f"rank {f.rank}" if f.rank is not None else "before its first round"
        others = f" (first of {self.failures} failures)" if self.failures > 1 else ""
        lines = [f"root cause{others}: worker {f.worker_id} ({rank}) on {f.host} "
                 f"failed at {stamp(f.at)}: {f.reason}"]
        if f.error_file:
            lines.append(f"  error file: {f.error_file}")
        if f.details:
            lines.append(f"  last lines of its {f.source}:" if f.source == "stderr"
                         else "  traceback (from its error file):")
            lines.extend(f"    {line}" for line in f.details)
        return lines

    def report(self) -> None:
        """Print the root-cause block: its first line timestamped like every driver
        line, the traceback below it as it is."""
        lines = self.root_cause()
        if lines:
            log.error("%s", lines[0])
            sys.stderr.write("".join(f"elasticrun: {line}\n" for line in lines[1:]))
            sys.stderr.flush()
