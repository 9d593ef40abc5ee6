"""Who holds the training state: a round in which no member holds it is never formed.

Every worker's heartbeat says which commit its state holds (-1 before its first sync)
and the newest checkpoint it wrote or resumed from (stalls.Liveness). Members of a
round that synced hold the same commit; a newcomer holds nothing until its first sync.
If every holder is gone (killed, or preempted, during a scale-up), the newcomers alone
would sync their fresh state to each other and train from step 0. Instead:

* with a durable checkpoint (a worker reported writing one, or resuming from one), the
  round forms with one warning, and its rank 0 loads the newest checkpoint at its sync
  (its state holds no commit: checkpointer.before_sync);
* without one, the job stops: ``no surviving worker holds the training state; the last
  commit was N``, a non-zero exit.

A newcomer that synced just before the last holder died reports so within its next
heartbeat: the decision waits ``holder_grace`` for that.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from elastic.runner.decisions import (
    Fail,
    Limits,
    MarkHolderless,
    NoteCommit,
    Notice,
    PolicyTick,
    WorkerView,
)

if TYPE_CHECKING:
    from elastic.messages import Member

HOLDER_GRACE_S = 3.0      # at least this long for a holder's heartbeat to say so


def holder_grace(limits: Limits) -> float:
    """Seconds a round without a known holder waits for a late heartbeat."""
    return max(HOLDER_GRACE_S, limits.worker_timeout / 5)


def note_commits(tick: PolicyTick) -> None:
    """On a liveness tick: the newest commit and checkpoint any worker reported."""
    job = tick.job
    commit, durable = job.commit, job.durable
    for w in tick.workers.values():
        if w.liveness is not None:
            commit, durable = max(commit, w.liveness.holds), max(durable, w.liveness.durable)
    if commit > job.commit or durable > job.durable:
        tick.emit(NoteCommit(commit, durable))


def holds_state(worker_view: WorkerView) -> bool:
    return worker_view.liveness is not None and worker_view.liveness.holds >= 0


def may_form(tick: PolicyTick, target: Iterable[Member]) -> bool:
    """Whether the round ``target`` (its Members) may form: some member holds the state,
    or there is a checkpoint to resume from. Emits the warning, or the Fail."""
    job = tick.job
    if job.commit < 0 or any(holds_state(tick.workers[m.worker_id]) for m in target
                             if m.worker_id in tick.workers):
        if job.holderless_since is not None:
            tick.emit(MarkHolderless(None))
        return True
    if job.holderless_since is None:
        tick.emit(MarkHolderless(tick.now))
    since = tick.job.holderless_since           # set just above if it was not
    if since is not None and tick.now - since < holder_grace(tick.limits):
        return False
    if job.durable >= 0:
        tick.emit(MarkHolderless(None))
        tick.emit(Notice(f"no surviving worker holds the training state (the last commit was "
                         f"{job.commit}); resuming from the newest checkpoint (commit "
                         f"{job.durable} or newer)", "state_lost",
                         (("commit", job.commit), ("checkpoint", job.durable))))
        return True
    tick.emit(Fail(f"no surviving worker holds the training state; the last commit was "
                   f"{job.commit}"))
    return False
