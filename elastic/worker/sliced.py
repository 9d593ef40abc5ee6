"""The one way a worker waits on its peers: in slices, watching the round's abort.

A gloo peer blocked on another survivor does not notice a death until the group's
timeout, and an NCCL future completes when the kernel is queued, so no wait on
a round may simply block (docs/architecture.md, "Why waits are sliced").
``wait_sliced`` is that loop, written once: what it waits for, how it sleeps,
the clock and the abort check are passed in, so gloo work (an event), a
builder thread (its join), NCCL work (polled) and a fake clock in a unit test
all go through the same code.

How to use it for a new wait: give ``ready`` (cheap, no store reads) and a
``sleep`` that returns early once ready where it can (``Event.wait``,
``Thread.join``); the abort check runs only after a slice found the work
unfinished, so work that completes quickly never costs a store look.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

from elastic.exceptions import WorkersDepartedError

WAIT_SLICE_S = 0.1
DEFAULT_TIMEOUT_S = 600.0
# In a small round a wait on gloo work first looks at the abort after FIRST_LOOK_S and
# doubles up to WAIT_SLICE_S: a survivor blocked on another survivor learns of a crash
# (a member's failure report, rounds.round_aborted) at +0.02/+0.06 s of its wait, not
# +0.1 s (docs/benchmarks.md, "Pauses between hosts"). Two or three more looks per long
# wait; in a big round, where they would add up on the store, slices stay even.
FIRST_LOOK_S = 0.02
FIRST_LOOKS_MAX_SIZE = 64


class AbortWatch(Protocol):
    """What a wait on a round watches: the round, whether the driver aborted it, and
    the longest any wait in it may take. ``Worker`` is one; tests pass a fake."""

    round_id: int
    collective_timeout: float

    def round_aborted(self) -> bool: ...


def never_aborted() -> bool:
    """The abort check outside a round (standalone, or no watch given)."""
    return False


def wait_sliced(ready: Callable[[], bool], aborted: Callable[[], bool], deadline_s: float,
                what: str, *, slice_s: float = WAIT_SLICE_S, first_s: float | None = None,
                clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], object] = time.sleep,
                on_abandon: Callable[[], None] | None = None,
                aborted_why: str = "the round was aborted", gave_up: str | None = None) -> None:
    """Return once ``ready()``; raise WorkersDepartedError once ``aborted()`` or after
    ``deadline_s`` (by ``clock``).

    ``sleep(s)`` waits one slice (it may return early); with ``first_s`` the slices
    start that short and double up to ``slice_s`` (polled work, which usually
    completes within microseconds). ``on_abandon`` runs before giving up (abort an
    NCCL communicator). The error says "``what`` abandoned: ``aborted_why``" or
    "``what`` timed out"; ``gave_up`` replaces both (e.g. "... did not form").
    An exception from ``ready()`` propagates as it is.
    """
    if ready():
        return
    deadline = clock() + deadline_s
    pause = slice_s if first_s is None else min(first_s, slice_s)
    while True:
        sleep(pause)
        pause = min(pause * 2, slice_s)
        if ready():
            return
        if aborted():
            _abandon(on_abandon, gave_up or f"{what} abandoned: {aborted_why}")
        if clock() > deadline:
            _abandon(on_abandon, gave_up or f"{what} timed out")


def _abandon(on_abandon: Callable[[], None] | None, message: str) -> None:
    if on_abandon is not None:
        on_abandon()
    raise WorkersDepartedError(message)


def first_look_s(size: int | None) -> float | None:
    """``wait_sliced``'s ``first_s`` for a wait on gloo work in a round of ``size``
    (None outside a round): short first looks in a small round only."""
    return FIRST_LOOK_S if size is not None and 0 < size <= FIRST_LOOKS_MAX_SIZE else None


def watched(watch: AbortWatch | None) -> tuple[Callable[[], bool], float, str]:
    """(abort check, deadline in seconds, why an abort says) for a wait in ``watch``'s
    round; outside a round nothing aborts and the default timeout applies."""
    if watch is None:
        return never_aborted, DEFAULT_TIMEOUT_S, "the round was aborted"
    return watch.round_aborted, watch.collective_timeout, f"round {watch.round_id} was aborted"
