"""The worker side of ``elastic.launch``: ``python -m elastic.launching.worker PAYLOAD RESULTS``.

Loads the pickled call, runs it, and writes what it returned to
``RESULTS/round.<round>/<rank>.pkl``, where round and rank are the worker's
membership once the function has returned (``elastic.rank()``): a worker that
finished in the final round files its result under that round. If loading or
running the function raises, the worker writes ``RESULTS/errors/<worker>.json``
(type, message, traceback) for the caller's ``LaunchError`` and re-raises, so
it exits non-zero as any failed training script does.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import sys
import time
import traceback
from typing import Any

from elastic import protocol

ERRORS = "errors"


def _worker_id() -> str:
    return os.environ.get(protocol.ENV_WORKER_ID, "solo")


def _current_rank() -> int | None:
    """The rank of the round this worker is in, without joining one."""
    from elastic.worker import runtime
    membership = runtime.current_membership()
    if membership is not None:
        return membership.rank
    return protocol.rank_from_env()


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _record_error(results_dir: str, exc: BaseException) -> None:
    try:
        rank = _current_rank()
    except Exception:  # noqa: BLE001 - the record must not hide the original error
        rank = None
    message = str(exc)
    record = {
        "worker": _worker_id(),
        "host": os.environ.get(protocol.ENV_HOSTNAME) or socket.gethostname(),
        "rank": rank,
        "time": time.time(),
        "type": type(exc).__qualname__,
        "message": message if len(message) <= 2000 else message[:1997] + "...",
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }
    try:
        path = os.path.join(results_dir, ERRORS, f"{_worker_id()}.json")
        _write_atomic(path, json.dumps(record).encode())
    except OSError as err:
        sys.stderr.write(f"elastic.launching.worker: cannot record the error: {err}\n")


def _load(payload_path: str) -> Any:      # the pickled (fn, args, kwargs)
    with open(payload_path, "rb") as f:
        payload = pickle.load(f)
    for entry in payload["sys_path"]:
        if entry not in sys.path:
            sys.path.append(entry)
    import cloudpickle
    return cloudpickle.loads(payload["call"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.stderr.write("usage: python -m elastic.launching.worker PAYLOAD RESULTS_DIR\n")
        return 2
    payload_path, results_dir = argv
    try:
        fn, args, kwargs = _load(payload_path)
        value = fn(*args, **kwargs)
        import cloudpickle

        import elastic
        from elastic.worker import runtime
        rank, size = elastic.rank(), elastic.size()
        worker = runtime.worker()
        round_id = worker.round_id if worker is not None else 0
        data = cloudpickle.dumps({"rank": rank, "size": size, "round": round_id,
                                  "worker": _worker_id(), "value": value})
    except Exception as exc:
        _record_error(results_dir, exc)
        raise
    folder = os.path.join(results_dir, f"round.{round_id}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    _write_atomic(os.path.join(folder, f"{rank}.pkl"), data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
