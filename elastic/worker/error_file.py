"""A worker's uncaught exception, kept in a file for the driver's root-cause report.

As torchrun's error files do: when a worker dies of an exception, the
driver's one line "exited with code 1" is not enough to tell why. The worker
writes ``$ELASTIC_ERROR_DIR/worker.<id>/error.json`` (rank, host, worker id,
time, traceback) from ``sys.excepthook`` before Python prints the traceback;
the driver reads it when the worker's exit is the job's first failure.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from types import TracebackType

from elastic import protocol
from elastic.worker import runtime

MESSAGE_CHARS = 2000
ERROR_FILE = "error.json"


def error_path(error_dir: str, worker_id: str) -> str:
    return os.path.join(error_dir, f"worker.{worker_id}", ERROR_FILE)


def record(kind: type[BaseException], value: BaseException,
           tb: TracebackType | None) -> dict[str, object]:
    """What the file holds for the exception ``value``."""
    try:
        membership = runtime.current_membership()
        rank = membership.rank if membership is not None else protocol.rank_from_env()
    except Exception:  # noqa: BLE001 - the record must never hide the original error
        rank = None
    message = str(value)
    return {
        "worker": os.environ.get(protocol.ENV_WORKER_ID, "solo"),
        "host": os.environ.get(protocol.ENV_HOSTNAME) or socket.gethostname(),
        "rank": rank,
        "pid": os.getpid(),
        "time": time.time(),
        "type": kind.__qualname__,
        "message": message if len(message) <= MESSAGE_CHARS else message[:MESSAGE_CHARS] + "...",
        "traceback": "".join(traceback.format_exception(kind, value, tb)),
    }


def write(kind: type[BaseException], value: BaseException,
          tb: TracebackType | None) -> str | None:
    """Write the error file when the driver asked for one; its path, or None.

    Only where the directory exists: on the driver's machine, or on a filesystem
    it shares. A remote host without it keeps nothing (the driver then shows the
    worker's stderr tail instead)."""
    error_dir = os.environ.get(protocol.ENV_ERROR_DIR)
    if not error_dir or not os.path.isdir(error_dir) \
            or issubclass(kind, (KeyboardInterrupt, SystemExit)):
        return None
    path = error_path(error_dir, os.environ.get(protocol.ENV_WORKER_ID, "solo"))
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record(kind, value, tb), f)
        os.replace(tmp, path)
    except OSError as exc:
        sys.stderr.write(f"elastic: cannot write the error file {path}: {exc}\n")
        return None
    return path


_installed = False


def install() -> None:
    """Chain a ``sys.excepthook`` that writes the error file, then prints as before."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException,
             tb: TracebackType | None) -> None:
        write(kind, value, tb)
        previous(kind, value, tb)

    sys.excepthook = hook
