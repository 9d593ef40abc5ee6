"""Sliced waits: every wait on torch.distributed work can be abandoned.

A gloo peer blocked on another survivor does not notice a death until its own
timeout, so work is waited on in short slices that watch the round's abort
key (docs/architecture.md, "Why waits are sliced"). Any backend failure surfaces as
WorkersDepartedError, which the run loop turns into restore-and-rejoin.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from elastic.exceptions import WorkersDepartedError

if TYPE_CHECKING:
    from elastic.worker.runtime import Worker

WAIT_SLICE_S = 0.1
DEFAULT_TIMEOUT_S = 600.0


def issue(start: Callable[[], Any], what: str) -> Any:
    """Start async work; a backend error becomes WorkersDepartedError."""
    try:
        return start()
    except WorkersDepartedError:
        raise
    except Exception as exc:  # noqa: BLE001 - any backend failure means a peer is gone
        raise WorkersDepartedError(f"{what} failed: {exc}") from exc


def wait(work: Any, what: str = "collective", worker: Worker | None = None) -> None:
    """Wait for ``work`` in slices; abandon it if ``worker``'s round is aborted.

    The worker's progress (liveness.py) says what it waits in meanwhile, so the
    driver can tell a rank its peers wait on from one that waits itself.
    """
    if worker is None:
        return _wait(work, what, None)
    worker.progress.begin_wait(what, worker.round_id)
    try:
        return _wait(work, what, worker)
    finally:
        worker.progress.end_wait()


def _wait(work: Any, what: str, w: Worker | None) -> None:
    if w is not None and w.polls_work:
        from elastic.worker import nccl
        nccl.wait_polling(work, WAIT_SLICE_S, w.collective_timeout, w.round_aborted, what,
                          on_abandon=w.abort_device_group)
        return
    error, waited = [], []
    if not work.is_completed():
        done = threading.Event()
        try:
            work.get_future().add_done_callback(lambda _fut: done.set())
        except RuntimeError:
            # Point-to-point work has no future: a helper thread blocks for us.
            def block():
                try:
                    work.wait()
                except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                    error.append(exc)
                waited.append(True)
                done.set()
            threading.Thread(target=block, daemon=True, name="elastic-wait").start()
        deadline = time.monotonic() + (w.collective_timeout if w else DEFAULT_TIMEOUT_S)
        while not done.wait(WAIT_SLICE_S):
            if w is not None and w.round_aborted():
                raise WorkersDepartedError(f"{what} abandoned: round {w.round_id} was aborted")
            if time.monotonic() > deadline:
                raise WorkersDepartedError(f"{what} timed out")
    try:
        if error:
            raise error[0]
        if not waited:
            work.wait()
    except Exception as exc:  # noqa: BLE001 - any backend failure means a peer is gone
        raise WorkersDepartedError(f"{what} failed: {exc}") from exc


def run_blocking(fn: Callable[[], Any], what: str, worker: Worker | None = None) -> Any:
    """Run ``fn`` (which blocks on gloo work) on a helper thread and wait for it in
    slices that watch ``worker``'s abort key; return what it returns.

    For point-to-point work, which cannot be waited on in slices itself. On an abort
    the thread is left behind, blocked on the round's group, which is abandoned anyway.
    """
    w = worker
    box, done = {}, threading.Event()

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, daemon=True, name="elastic-transfer").start()
    deadline = time.monotonic() + (w.collective_timeout if w else DEFAULT_TIMEOUT_S)
    while not done.wait(WAIT_SLICE_S):
        if w is not None and w.round_aborted():
            raise WorkersDepartedError(f"{what} abandoned: round {w.round_id} was aborted")
        if time.monotonic() > deadline:
            raise WorkersDepartedError(f"{what} timed out")
    if "error" in box:
        exc = box["error"]
        if isinstance(exc, WorkersDepartedError):
            raise exc
        raise WorkersDepartedError(f"{what} failed: {exc}") from exc
    return box.get("result")
