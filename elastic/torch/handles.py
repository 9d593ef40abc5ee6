"""Handles for the ``*_async`` ops: ``poll`` and ``synchronize``, and in-flight names.

An async op agrees with its peers when it is issued (a short exchange), then
its data moves in the background; the handle waits for it in the framework's
sliced, abort-aware waits, so a departed peer still raises
WorkersDepartedError. A mismatch found at issue time is raised by
``synchronize``, as Horovod raises it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from elastic.worker import collectives, runtime

if TYPE_CHECKING:
    import torch.distributed as dist

    from elastic.worker.waiting import RoundWaits

NameKey = tuple[str, str]     # (op kind, name) of a named op in flight
_in_flight: dict[NameKey, int] = {}    # -> round id
_lock = threading.Lock()


def _round() -> int:
    w = runtime.worker()
    return w.round_id if w is not None else 0


def claim_name(kind: str, name: str | None) -> NameKey | None:
    """Reserve ``name`` for an op in flight; a second op by the same name is a ValueError."""
    if name is None:
        return None
    key = (kind, str(name))
    current = _round()
    with _lock:
        if _in_flight.get(key) == current:
            raise ValueError(f"{kind} '{name}': another {kind} by this name is still in flight; "
                             "names of ops in flight must be unique (synchronize the first one)")
        _in_flight[key] = current
    return key


def release_name(key: NameKey | None) -> None:
    if key is not None:
        with _lock:
            _in_flight.pop(key, None)


class Handle:
    """An op in flight: backend works to wait on, then ``finish()`` builds the result."""

    dim0s: list[list[int]]   # allgather's: every rank's dim 0, per tensor (set when known)

    def __init__(self, works: Iterable[dist.Work] = (), finish: Callable[[], Any] | None = None,
                 worker: RoundWaits | None = None, name_key: NameKey | None = None,
                 error: BaseException | None = None, what: str = "op") -> None:
        self._works = list(works)
        self._finish = finish
        self._worker = worker
        self._name_key = name_key
        self._error = error
        self._what = what
        self._done = False
        self._result: Any = None

    @classmethod
    def done(cls, result: Any) -> Handle:
        handle = cls()
        handle._done, handle._result = True, result
        return handle

    @classmethod
    def failed(cls, error: BaseException, name_key: NameKey | None = None) -> Handle:
        return cls(error=error, name_key=name_key)

    def __call__(self) -> Any:
        """Horovod's sparse_allreduce_async returns a function to call; ours can be called too."""
        return self.wait()

    def poll(self) -> bool:
        if self._done or self._error is not None:
            return True
        return all(work.is_completed() for work in self._works)

    def wait(self) -> Any:
        if self._done:
            return self._result
        try:
            if self._error is not None:
                raise self._error
            for work in self._works:
                collectives.wait(work, self._what, self._worker)
            self._result = self._finish() if self._finish is not None else None
            self._done = True
            return self._result
        finally:
            release_name(self._name_key)
            self._name_key = None


def poll(handle: Handle) -> bool:
    """True when ``synchronize(handle)`` would return without waiting."""
    return _checked(handle).poll()


def synchronize(handle: Handle) -> Any:
    """Wait for an async op and return its output (raises what the op raised)."""
    return _checked(handle).wait()


def _checked(handle: object) -> Handle:
    if not isinstance(handle, Handle):
        raise ValueError(f"not a handle of an elastic.torch async op: {handle!r}")
    return handle
