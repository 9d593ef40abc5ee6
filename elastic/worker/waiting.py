"""Sliced waits on torch.distributed work: every one can be abandoned.

A gloo peer blocked on another survivor does not notice a death until its own
timeout, so work is waited on in short slices that watch the round's abort
key (docs/architecture.md, "Why waits are sliced"); the loop itself is
``sliced.wait_sliced``. Any backend failure surfaces as WorkersDepartedError,
which the run loop turns into restore-and-rejoin.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from elastic.exceptions import WorkersDepartedError
from elastic.worker.sliced import (
    DEFAULT_TIMEOUT_S,
    WAIT_SLICE_S,
    AbortWatch,
    first_look_s,
    wait_sliced,
    watched,
)

if TYPE_CHECKING:
    from elastic.worker.liveness import Progress

__all__ = ["DEFAULT_TIMEOUT_S", "WAIT_SLICE_S", "Blockers", "RoundWaits", "blocker_threads", "issue",
           "run_blocking", "wait"]


class RoundWaits(AbortWatch, Protocol):
    """What a wait on a round's work reads besides the abort: where it says it waits
    (the heartbeat reports it), and whether the round's work must be polled (NCCL)."""

    progress: Progress

    @property
    def polls_work(self) -> bool: ...

    def abort_device_group(self) -> None: ...


class Blockers:
    """Threads that block on work for a sliced wait (work without a future: point-to-point,
    gloo's reduce-scatter), kept for the next one: FSDP2 waits on a reduce-scatter per
    layer per step, and a thread started for each cost more than the wait.

    A thread blocked on abandoned work stays blocked until that work fails (its group
    closed or timed out); the next wait gets another thread meanwhile."""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []
        self._mu = threading.Lock()
        self.started = 0

    def run(self, fn: Callable[[], None]) -> None:
        with self._mu:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), daemon=True,
                             name="elastic-wait").start()
            self.started += 1
        inbox.put(fn)

    def _serve(self, inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            inbox.get()()
            with self._mu:
                self._idle.append(inbox)


_blockers = Blockers()


def blocker_threads() -> int:
    """Threads started so far to block on work without a future (tests: they are reused)."""
    return _blockers.started


def issue(start: Callable[[], Any], what: str) -> Any:
    """Start async work; a backend error becomes WorkersDepartedError."""
    try:
        return start()
    except WorkersDepartedError:
        raise
    except Exception as exc:  # noqa: BLE001 - any backend failure means a peer is gone
        raise WorkersDepartedError(f"{what} failed: {exc}") from exc


def wait(work: Any, what: str = "collective", worker: RoundWaits | None = None) -> None:
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


def _wait(work: Any, what: str, w: RoundWaits | None) -> None:
    aborted, deadline_s, why = watched(w)
    if w is not None and w.polls_work:
        from elastic.worker import nccl
        nccl.wait_polling(work, WAIT_SLICE_S, deadline_s, aborted, what,
                          on_abandon=w.abort_device_group)
        return
    error, waited = [], []
    if not work.is_completed():
        done = threading.Event()
        try:
            work.get_future().add_done_callback(lambda _fut: done.set())
        except RuntimeError:
            # Point-to-point work has no future: a helper thread blocks for us.
            def block() -> None:
                try:
                    work.wait()
                except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                    error.append(exc)
                waited.append(True)
                done.set()
            _blockers.run(block)
        membership = getattr(w, "membership", None)      # a fake round may have none
        wait_sliced(done.is_set, aborted, deadline_s, what, sleep=done.wait, aborted_why=why,
                    first_s=first_look_s(membership.size if membership is not None else None))
    try:
        if error:
            raise error[0]
        if not waited:
            work.wait()
    except Exception as exc:  # noqa: BLE001 - any backend failure means a peer is gone
        raise WorkersDepartedError(f"{what} failed: {exc}") from exc


def run_blocking(fn: Callable[[], Any], what: str, worker: AbortWatch | None = None) -> Any:
    """Run ``fn`` (which blocks on gloo work) on a helper thread and wait for it in
    slices that watch ``worker``'s abort key; return what it returns.

    For point-to-point work, which cannot be waited on in slices itself. On an abort
    the thread is left behind, blocked on the round's group, which is abandoned anyway.
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, daemon=True, name="elastic-transfer").start()
    aborted, deadline_s, why = watched(worker)
    wait_sliced(done.is_set, aborted, deadline_s, what, sleep=done.wait, aborted_why=why)
    if "error" in box:
        exc = box["error"]
        if isinstance(exc, WorkersDepartedError):
            raise exc
        raise WorkersDepartedError(f"{what} failed: {exc}") from exc
    return box.get("result")
