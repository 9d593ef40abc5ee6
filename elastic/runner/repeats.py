"""Faults that repeat are decided in a bounded number of attempts, never retried forever.

Pure functions over a small record (``Repeats``, kept in the driver's ``Job``); the
policy asks them each time a round fails, and acts on the verdict.

* **A round that fails with the same members** (a worker reported a failed collective
  or group set-up and no process died): after ``--repeat-limit`` (default
  ``GROUP_REPEAT_LIMIT``) such rounds in a row, the hosts whose workers reported the
  failure in every one of them are blamed and blacklisted (their peers could form the
  group; they could not: a NIC name that differs, a firewall that opens only the store
  port). When every host reported it
  (a user bug inside a collective, one host only), no host can be blamed: the job
  stops with one line that carries the error.
* **A rank that fails at the same commit on one host after another** (a rank-0-only
  phase longer than --stall-timeout, an exception raised on one rank only): after
  ``RANK_REPEAT_LIMIT`` such failures the job stops with one line naming the cause and
  what to change, instead of blacklisting host after host. "The same commit": the job's
  newest commit did not move between the failures (heartbeats report it; one that lags
  at the first failure costs at most one more attempt).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic.messages import Member

GROUP_REPEAT_LIMIT = 3    # --repeat-limit's default: failed rounds in a row, same members
RANK_REPEAT_LIMIT = 2     # failures of one rank at one commit on different hosts, then stop
ERROR_CHARS = 300         # how much of a worker's error text travels (one line)


def one_line(text: object, limit: int = ERROR_CHARS) -> str:
    """``text`` as a single line of at most ``limit`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 1] + "…"


@dataclass(frozen=True)
class RankTally:
    commit: int          # the job's newest commit when the first of these failures came
    hosts: tuple         # hosts the rank failed on, in order
    why: str             # the last failure, in words


@dataclass(frozen=True)
class Repeats:
    members: frozenset = frozenset()   # worker ids of the rounds that failed in a row
    failed: tuple = ()                 # per such round: the hosts whose workers reported it
    ranks: Mapping = field(default_factory=dict)    # (kind, rank) -> RankTally


@dataclass(frozen=True)
class Blame:
    hosts: tuple
    line: str            # why, for the blacklisting


@dataclass(frozen=True)
class StopJob:
    line: str            # the job's one error line


def describe_errors(members: Iterable[Member], errors: Mapping[str, str]) -> str:
    """'worker 1 on b (rank 1): <error>; ...' for the members that reported one."""
    parts = []
    for m in members:
        text = errors.get(m.worker_id)
        if text is not None:
            parts.append(f"worker {m.worker_id} on {m.host} (rank {m.rank}): "
                         f"{one_line(text) or 'no error text'}")
    return "; ".join(parts) or "no error text"


def group_failure(repeats: Repeats, round_id: int, members: Sequence[Member],
                  errors: Mapping[str, str], limit: int = GROUP_REPEAT_LIMIT,
                  ) -> tuple[Repeats, Blame | StopJob | None]:
    """A round (``members``: its Members) failed without a process dying; ``errors``:
    worker id -> error text of those that reported it. Returns (repeats, verdict) with
    verdict None (re-form and try again), a Blame or a StopJob."""
    ids = frozenset(m.worker_id for m in members)
    reporters = frozenset(m.host for m in members if m.worker_id in errors)
    failed = repeats.failed if ids == repeats.members else ()
    failed = (failed + (reporters,))[-limit:]
    repeats = replace(repeats, members=ids, failed=failed)
    if len(failed) < limit:
        return repeats, None
    repeats = replace(repeats, members=frozenset(), failed=())
    hosts = list(dict.fromkeys(m.host for m in members))
    always = [h for h in hosts if all(h in f for f in failed)]
    text = describe_errors(members, errors)
    if always and len(always) < len(hosts):
        return repeats, Blame(tuple(always), (
            f"round {round_id} failed {limit} times in a row with the same members, and "
            f"only the workers on {', '.join(always)} reported it ({text})"))
    return repeats, StopJob(
        f"round {round_id} failed {limit} times in a row with the same members and no host "
        f"to blame (every host reported it): {text}")


def rank_failure(repeats: Repeats, kind: str, rank: int, host: str, commit: int, why: str,
                 advice: str, limit: int = RANK_REPEAT_LIMIT) -> tuple[Repeats, StopJob | None]:
    """Rank ``rank`` failed on ``host`` (``kind``: "stall" or "exception") while the job's
    newest commit was ``commit``. Returns (repeats, StopJob or None)."""
    key = (kind, rank)
    tally = repeats.ranks.get(key)
    if tally is None or commit > tally.commit or host in tally.hosts:
        tally = RankTally(commit, (), why)
    tally = RankTally(tally.commit, tally.hosts + (host,), why)
    ranks = {k: v for k, v in repeats.ranks.items() if k != key}
    if len(tally.hosts) < limit:
        return replace(repeats, ranks={**ranks, key: tally}), None
    return replace(repeats, ranks=ranks), StopJob(
        f"rank {rank} failed on {len(tally.hosts)} hosts in a row with no commit in between "
        f"({', '.join(tally.hosts)}): {why}; {advice}")
