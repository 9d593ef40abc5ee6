"""Futures that a round's abort fails: DDP waits on its comm hooks' futures in C++,
where no sliced wait can reach, so a survivor waiting on another survivor would
block until the group's timeout (docs/architecture.md, "Why waits are sliced").

``abortable(fut, group)`` returns a Python future that takes ``fut``'s result
when it completes, and fails with WorkersDepartedError when the group's round
is aborted or ended, or its collective timeout passes. One watcher thread per
process looks at the abort key, and only while some future has been pending
longer than a wait slice, on a connection of its own: steady training, whose
futures complete within the slice, costs the store nothing.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from elastic.exceptions import WorkersDepartedError
from elastic.protocol import Keys
from elastic.worker import waiting

if TYPE_CHECKING:
    from elastic.protocol import ControlStore
    from elastic.worker.torch_world import RoundGroup, RoundMember


class _Pending:
    __slots__ = ("future", "group", "since", "done")

    def __init__(self, future: torch.futures.Future[Any], group: RoundGroup) -> None:
        self.future, self.group, self.since, self.done = future, group, time.monotonic(), False


class Watcher:
    """Fails pending futures of rounds that were aborted or ended."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._conn: ControlStore | None = None   # our own store connection, made on the first look
        self._conn_worker: RoundMember | None = None

    def watch(self, inner: torch.futures.Future[Any],
              group: RoundGroup) -> torch.futures.Future[Any]:
        out: torch.futures.Future[Any] = torch.futures.Future()
        entry = _Pending(out, group)

        def settle(fut: torch.futures.Future[Any]) -> None:
            try:
                value = fut.value()
            except Exception as exc:  # noqa: BLE001 - handed on to the waiter
                self._finish(entry, error=WorkersDepartedError(f"collective failed: {exc}"))
            else:
                self._finish(entry, value=value)

        with self._cv:
            self._pending.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="elastic-future-watch")
                self._thread.start()
            self._cv.notify()
        inner.add_done_callback(settle)
        return out

    def _finish(self, entry: _Pending, value: Any = None,
                error: BaseException | None = None) -> None:
        with self._cv:
            if entry.done:
                return
            entry.done = True
            self._pending = [p for p in self._pending if not p.done]
        if error is not None:
            entry.future.set_exception(error)
        else:
            entry.future.set_result(value)

    def pending(self) -> int:
        with self._cv:
            return len(self._pending)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending:
                    self._cv.wait()
                self._cv.wait(waiting.WAIT_SLICE_S)
                now = time.monotonic()
                slow = [p for p in self._pending if now - p.since >= waiting.WAIT_SLICE_S]
            for entry in slow:
                why = self._why_stop(entry.group, now - entry.since)
                if why:
                    self._finish(entry, error=WorkersDepartedError(why))

    def _why_stop(self, group: RoundGroup, waited: float) -> str | None:
        if group.ended:
            return f"round {group.round_id}'s process group has ended"
        if waited > group.worker.collective_timeout:
            return f"collective timed out in round {group.round_id}"
        if self._aborted(group):
            return f"collective abandoned: round {group.round_id} was aborted"
        return None

    def _aborted(self, group: RoundGroup) -> bool:
        w = group.worker
        try:
            if self._conn is None or self._conn_worker is not w:
                self._conn, self._conn_worker = w.new_control_connection(), w
            return self._conn.has(Keys.abort(group.round_id))
        except Exception:  # noqa: BLE001 - a new connection next time; the timeout backstops
            self._conn = None
            return False


_watcher = Watcher()


def abortable(inner: torch.futures.Future[Any], group: RoundGroup) -> torch.futures.Future[Any]:
    """``inner``'s outcome, or WorkersDepartedError once ``group``'s round is over."""
    return _watcher.watch(inner, group)


def pending() -> int:
    """Futures still watched (tests: nothing is left behind)."""
    return _watcher.pending()
