"""The policy's steps for faults that repeat (repeats.py decides; these emit the actions).

Each function takes the policy's tick (``policy._Tick``: ``job``, ``facts``, ``limits``,
``now``, ``emit`` and ``host_failed``) and is pure as the tick is.
"""

from __future__ import annotations

from elastic.runner.decisions import (
    Abort,
    Fail,
    MarkFailureReport,
    Notice,
    PolicyTick,
    Reform,
    Track,
)
from elastic.runner.repeats import (
    Blame,
    StopJob,
    describe_errors,
    group_failure,
    one_line,
    rank_failure,
)

FAILURE_REPORT_GRACE_S = 1.0   # a reported collective failure waits for the exit that explains it
STALL_ADVICE = ("a phase that only this rank runs (rank-0-only evaluation, say) outlasts "
                "--stall-timeout while its peers wait in a collective; raise --stall-timeout")
EXCEPTION_ADVICE = ("the script fails on that rank whichever host runs it, which is no host "
                    "fault: fix the script (its traceback is in the worker's output)")


def check_failure_reports(tick: PolicyTick) -> None:
    """A worker saw a collective fail but no process died (yet): re-form the round."""
    job = tick.job
    r = job.round_id
    if not r or r in job.aborted or job.final_round is not None:
        if job.failure_report_at is not None:
            tick.emit(MarkFailureReport(None))
        return
    if tick.facts.failure_reports == 0:
        return
    if job.failure_report_at is None:
        tick.emit(MarkFailureReport(tick.now))
    since = tick.job.failure_report_at          # set just above if it was not
    if since is not None and tick.now - since >= FAILURE_REPORT_GRACE_S:
        failed_round(tick, r)
        tick.emit(MarkFailureReport(None))


def abort_failed_replaced(tick: PolicyTick) -> None:
    """A collective failed in a round that a newer one replaced after it assembled (a
    join published the newer round while the older one synced): the older round's other
    members still wait in it, and the newer round waits for them. Abort the older round so
    they move on; the newer round, not yet run, has nothing to re-form."""
    job = tick.job
    for round_id in tick.facts.replaced_failed:
        if round_id in job.aborted or round_id not in job.rounds or round_id >= job.round_id:
            continue
        tick.emit(Notice(f"round {round_id} failed after round {job.round_id} replaced it; "
                         "aborting it so its members join the new round", "replaced_round_aborted",
                         (("round", round_id), ("replaced_by", job.round_id))))
        tick.emit(Abort(round_id))


def failed_round(tick: PolicyTick, round_id: int) -> None:
    """The current round reported a failed collective and no process died: re-form it,
    naming the cause, until repeats.group_failure decides."""
    job, errors = tick.job, dict(tick.facts.failure_errors)
    limit = tick.limits.repeat_limit
    repeats, verdict = group_failure(job.repeats, round_id, job.members, errors, limit)
    text = describe_errors(job.members, errors)
    tries = f"{len(repeats.failed)} of {limit} with these members"
    tick.emit(Notice(f"round {round_id} failed: {text}" + (
        f"; re-forming it ({tries})" if verdict is None else ""), "round_failed", (
        ("round", round_id),
        ("errors", {w: one_line(e) for w, e in sorted(errors.items())}))))
    tick.emit(Track(repeats))
    if isinstance(verdict, StopJob):
        tick.emit(Fail(verdict.line))
    tick.emit(Reform())
    tick.emit(Abort(round_id))
    if isinstance(verdict, Blame):
        for host in verdict.hosts:
            wid = next((m.worker_id for m in job.members
                        if m.host == host and m.worker_id in errors),
                       next(m.worker_id for m in job.members if m.host == host))
            tick.host_failed(wid, host, verdict.line)


def rank_failed(tick: PolicyTick, kind: str, worker_id: str, host: str, why: str) -> None:
    """A member of the current round failed (``kind``: "stall" or "exception"); stops the
    job (a Fail) when its rank failed the same way at the same commit on other hosts."""
    rank = next((m.rank for m in tick.job.members if m.worker_id == worker_id), None)
    if rank is None or tick.job.commit < 0:
        return                    # not a member now, or no commit known to compare with
    advice = STALL_ADVICE if kind == "stall" else EXCEPTION_ADVICE
    repeats, verdict = rank_failure(tick.job.repeats, kind, rank, host, tick.job.commit,
                                    why, advice)
    tick.emit(Track(repeats))
    if isinstance(verdict, StopJob):
        tick.emit(Fail(verdict.line))
