"""Worker-side log lines: ``elastic[WORKER_ID]: message`` on stderr.

Modules log through ``logging.getLogger(__name__)``; this attaches the one
handler, on the ``elastic`` logger, that writes them in that format. It writes
to whatever ``sys.stderr`` is at the time (pytest swaps it) and does not
propagate, so a script's own logging set-up neither doubles nor hides them.
"""

import logging
import os
import sys

from elastic.protocol import ENV_WORKER_ID

ROOT = "elastic"


class _StderrHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never break the worker
            self.handleError(record)


class _WorkerFormat(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"elastic[{os.environ.get(ENV_WORKER_ID, '-')}]: {record.getMessage()}"


def install() -> None:
    """Idempotent: attach the stderr handler to the ``elastic`` logger once."""
    root = logging.getLogger(ROOT)
    if any(isinstance(h, _StderrHandler) for h in root.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(_WorkerFormat())
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


install()
