"""The narrow view of its round that a State and its Checkpointer are given.

A State commits, restores and syncs inside a round, and a Checkpointer writes
from rank 0 of one; neither needs the whole Worker. ``RoundView`` lists what
they use: the membership, the progress counters the heartbeat reports, the
round's CPU group and sliced waits on it, the commit's collective check, and
the control-store values a newcomer reserves from. ``WorkerRound`` is the real
one, over the process's Worker; the run loop hands it to the state it runs
(``State.use_round``), and unit tests hand a fake instead, with no worker and no
store (tests/test_state_seams.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

from elastic.protocol import Keys
from elastic.worker import collectives, runtime, waiting

if TYPE_CHECKING:
    import torch

    from elastic.state.states import State
    from elastic.worker.commits import CommitCheck
    from elastic.worker.groups import TrackedGroup
    from elastic.worker.liveness import Progress
    from elastic.worker.membership import Membership
    from elastic.worker.runtime import Worker


class RoundView(Protocol):
    """What a State and a Checkpointer read and call of the round they are in."""

    @property
    def membership(self) -> Membership | None:
        """This worker's place in the round (None between rounds)."""

    @property
    def progress(self) -> Progress:
        """The counters the heartbeat reports (commits, the commit held, durable)."""

    @property
    def cpu_group(self) -> TrackedGroup | None:
        """The round's gloo group, for the sync's point-to-point transfers."""

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, concatenated in rank order (a sliced wait)."""

    def run_blocking(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` (blocking on the round's group), abandoned if the round is aborted."""

    def check_commit(self, version: int) -> CommitCheck:
        """The commit's collective check; raises to stop, leave or re-form."""

    def committed(self, state: State) -> None:
        """``state`` committed: count it, and publish what a newcomer reserves (rank 0)."""

    def holds(self, version: int) -> None:
        """The state now holds commit ``version``: tell the driver at once."""

    def read_newcomer_spec(self, name: str) -> dict | None:
        """What rank 0 published for a state named ``name`` (Keys.state_spec), or None."""


class WorkerRound:
    """The RoundView of this process's Worker, whichever round it is in now."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self._published: dict[str, list] = {}    # state name -> flat specs put last

    @property
    def membership(self) -> Membership | None:
        return self.worker.membership

    @property
    def progress(self) -> Progress:
        return self.worker.progress

    @property
    def cpu_group(self) -> TrackedGroup | None:
        return self.worker.cpu_group

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        return collectives.allgather(tensor)

    def run_blocking(self, fn: Callable[[], Any], what: str) -> Any:
        return waiting.run_blocking(fn, what, self.worker)

    def check_commit(self, version: int) -> CommitCheck:
        return self.worker.check_commit(version)

    def committed(self, state: State) -> None:
        """Rank 0 puts the snapshot's flat specs in the control store when they change
        (the first commits, a new layout): one small put, not one per commit."""
        progress = self.worker.progress
        progress.committed()
        progress.holds = state.commit_version
        m = self.worker.membership
        if m is None or m.rank != 0:
            return
        name = type(state).__qualname__
        flats = state.snapshot.specs()
        if self._published.get(name) == flats:
            return
        try:
            self.worker.control.put(Keys.state_spec(name), state.newcomer_spec())
            self._published[name] = flats
        except Exception:  # noqa: BLE001 - only an optimization for newcomers
            pass

    def holds(self, version: int) -> None:
        progress = self.worker.progress
        if progress.holds != version:
            progress.holds = version     # the driver learns at once that we hold the state
            self.worker.heartbeat.wake()

    def read_newcomer_spec(self, name: str) -> dict | None:
        return self.worker.control.get(Keys.state_spec(name))


_current: WorkerRound | None = None


def current(connect: bool = False) -> WorkerRound | None:
    """The view of this process's worker, or None standalone or before elastic.init().
    Never connects or joins (runtime.worker() is a getter) unless ``connect``: then
    ``runtime.init()`` first, the entry point for a state used outside the run loop."""
    global _current
    if connect:
        runtime.init()
    w = runtime.worker()
    if w is None:
        return None
    if _current is None or _current.worker is not w:
        _current = WorkerRound(w)
    return _current
