"""What the driver's policy reasons about: the job's bookkeeping (``Job``, with its
``Phase``), the facts of one tick, the actions ``policy.decide`` returns, and
``evolve``, the one function that changes the bookkeeping.

Facts and actions are small frozen dataclasses, so a test can write a tick's
situation down and compare what comes back with ``==``.

The bookkeeping stays bounded however long the job runs (docs/architecture.md, "The
driver's tick"): only the last ``ROUNDS_KEPT`` rounds (and the final one) are remembered,
with their aborts, and failed exits only of workers in them. A worker that is in none of
them missed ``ROUNDS_KEPT`` membership changes: it is treated as never admitted.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol, Union

from elastic.messages import Member
from elastic.runner.hosts import HostManager
from elastic.runner.repeats import GROUP_REPEAT_LIMIT, Repeats

if TYPE_CHECKING:
    from elastic.runner.stalls import Liveness
    from elastic.runner.stragglers import StragglerRule

MIN_STARTUP_TIMEOUT_S = 120.0  # a process that never reaches elastic.init() is evicted after
ROUNDS_KEPT = 8                # rounds the bookkeeping remembers (the final one is kept too)


class MemberIds(tuple):
    """A round's member worker ids in rank order; ``in`` is a set lookup, not a scan."""

    def __new__(cls, ids=()):
        self = super().__new__(cls, ids)
        self.ids = frozenset(self)
        return self

    def __contains__(self, worker_id):
        return worker_id in self.ids


class Phase(Enum):
    STARTING = "starting"      # no round has formed yet
    RUNNING = "running"        # a round is training; growth is batched in at a commit
    REFORMING = "re-forming"   # a member is gone or a collective failed: a new round is needed
    FINISHING = "finishing"    # a worker finished: waiting for the final round to exit


# -- what the driver remembers between ticks --------------------------------------------------

@dataclass(frozen=True)
class Job:
    """The job's bookkeeping. Changed only by ``evolve``."""

    phase: Phase = Phase.STARTING
    round_id: int = 0
    members: tuple[Member, ...] = ()     # the current round's members (planner.assign)
    rounds: Mapping = field(default_factory=dict)    # round id -> MemberIds, the last ROUNDS_KEPT
    aborted: frozenset = frozenset()     # aborted rounds among those kept
    resets: int = 0
    host_order: tuple = ()               # hosts of the current round, oldest first
    next_worker: int = 0                 # the next worker id
    final_round: int | None = None
    final_codes: Mapping = field(default_factory=dict)   # final round's exit codes
    failed_exits: Mapping = field(default_factory=dict)  # worker id (in a kept round) -> code
    short_since: float | None = None     # since when too few slots stop the job going on
    failure_report_at: float | None = None
    last_failure: str | None = None
    preempted: Mapping = field(default_factory=dict)  # host -> when a worker there got SIGTERM
    stop_signal: int | None = None       # SIGTERM/SIGINT to elasticrun: stopping since stop_at
    stop_at: float | None = None
    quiet_since: float | None = None     # every heartbeat stopped at once then (blackout.py)
    quiet_ended: float = 0.0             # ... and came back then
    repeats: Repeats = Repeats()         # faults that repeat (repeats.py)
    commit: int = -1                     # the newest commit a worker reported holding
    durable: int = -1                    # the newest checkpoint a worker reported writing
    holderless_since: float | None = None    # no candidate holds the state (holders.py)
    stragglers: frozenset = frozenset()  # workers warned about as stragglers

    def member_ids(self) -> set:
        return set(self.member_set)

    @functools.cached_property
    def member_set(self) -> frozenset:
        """The current round's worker ids (computed once per Job: jobs never change)."""
        return frozenset(m.worker_id for m in self.members)

    @functools.cached_property
    def host_rank(self) -> dict:
        """host -> its place in ``host_order``."""
        return {h: i for i, h in enumerate(self.host_order)}

    def admitted(self, worker_id: str) -> bool:
        """Whether ``worker_id`` is a member of a round the bookkeeping keeps."""
        return any(worker_id in ids for ids in self.rounds.values())

    def left_out(self, worker_id: str) -> bool:
        """Admitted to a kept round but not a member of the current one: it exits once it
        reads the newer plan, so it is never planned again (a shrink, then a regrow before
        its process ended, would otherwise take back a worker that is leaving). Without a
        current round (a restarted driver adopting its predecessor's round) nobody is."""
        return bool(self.members) and worker_id not in self.member_set \
            and self.admitted(worker_id)


# -- facts ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Limits:
    """The parts of the job's configuration that decisions depend on."""

    np: int = 1
    min_np: int = 1
    max_np: int | None = None
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    repeat_limit: int = GROUP_REPEAT_LIMIT   # --repeat-limit: failed rounds alike, then decide
    worker_timeout: float = 30.0
    start_timeout: float | None = None   # elasticrun --start-timeout (horovodrun's)
    stop_timeout: float = 20.0       # to reach a commit after SIGTERM/SIGINT
    stall_timeout: float = 600.0     # peers waited this long on a rank that made no progress
    preempted_hold: float = 60.0     # a preempted host discovery keeps listing returns after
    stragglers: StragglerRule | None = None   # None: its defaults

    @property
    def startup_timeout(self) -> float:
        """A process that never reaches elastic.init() (a hung import) is evicted too."""
        if self.start_timeout is not None:
            return self.start_timeout
        return max(MIN_STARTUP_TIMEOUT_S, 4 * self.worker_timeout)


@dataclass(frozen=True)
class WorkerView:
    """A live worker process as the driver last saw it."""

    worker_id: str
    host: str
    slot: int
    started: float
    ready: bool = False
    stopped: bool = False
    beats: int = 0                # heartbeat counter
    heartbeat_at: float = 0.0     # when the counter last changed
    liveness: Liveness | None = None   # its training thread's progress
    leaving: Mapping | None = None      # its SIGTERM report (Keys.leaving), if any
    leaving_since: float | None = None  # when the driver learnt it


@dataclass(frozen=True)
class Exit:
    """A worker process that exited since the last tick."""

    worker_id: str
    host: str
    code: int
    stopped: bool = False         # the driver had stopped it
    ready: bool = False
    done_round: int | None = None  # the round it reported training done in
    note: str = ""                 # words after "exited with code N" (ssh failures)
    leaving: Mapping | None = None  # it got SIGTERM and left at a commit (Keys.leaving)
    fatal: str | None = None       # the line of an error that stops the job (worker/fatal.py)


@dataclass(frozen=True)
class Facts:
    job: Job
    limits: Limits
    hosts: HostManager                  # read only: decide copies it before its first change
    workers: Mapping = field(default_factory=dict)   # worker id -> WorkerView, in start order
    exits: tuple = ()                   # Exit, in the order the driver reaped them
    liveness_checked: bool = False      # heartbeat counters were read this tick
    failure_reports: int = 0            # the current round's failure counter
    failure_errors: Mapping = field(default_factory=dict)   # worker id -> its error text
    joined: int = 0                     # members that joined the current round so far
    stop_signal: int | None = None      # SIGTERM/SIGINT to elasticrun
    drained: frozenset = frozenset()    # hosts `elasticctl drain` took out: their workers leave
    replaced_failed: tuple = ()         # replaced rounds, not aborted, with a failure report


# -- actions ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spawn:
    worker_id: str
    host: str
    slot: int
    assignment: Member        # its tentative place: the ELASTIC_* env it starts with


@dataclass(frozen=True)
class Stop:
    worker_id: str


@dataclass(frozen=True)
class Evict:
    """Stopped for missing heartbeats or a hung start (a HostFailed follows)."""
    worker_id: str
    host: str


@dataclass(frozen=True)
class HostFailed:
    """Blacklist ``host``: ``worker_id`` failed there for ``reason``."""
    worker_id: str
    host: str
    reason: str


@dataclass(frozen=True)
class Abort:
    round_id: int


@dataclass(frozen=True)
class Reform:
    """The current round cannot go on; ``reason`` (if any) is worth a warning."""
    reason: str | None = None


@dataclass(frozen=True)
class Publish:
    round_id: int
    members: tuple[Member, ...]
    change: str               # "start" or describe_change's summary


@dataclass(frozen=True)
class Removed:
    worker_id: str
    host: str


@dataclass(frozen=True)
class RecordExit:
    """Bookkeeping: a failed exit, or the exit of a final-round worker."""
    worker_id: str
    code: int
    final: bool


@dataclass(frozen=True)
class StartFinishing:
    round_id: int
    members: tuple = ()       # for round 0 (scripts that never call elastic.init()): its workers


@dataclass(frozen=True)
class MarkShort:
    since: float | None       # None: no shortage any more


@dataclass(frozen=True)
class MarkFailureReport:
    at: float | None


@dataclass(frozen=True)
class Preempted:
    """A worker got SIGTERM: it leaves at its next commit; its host is held out, not blamed."""
    worker_id: str
    host: str
    signal: int
    at: float


@dataclass(frozen=True)
class Unpreempt:
    """Discovery dropped the preempted host (or the hold ran out): it may be used again."""
    host: str


@dataclass(frozen=True)
class Left:
    """A worker that got SIGTERM left at a commit: a graceful removal."""
    worker_id: str
    host: str
    commit: int | None


@dataclass(frozen=True)
class StallWarning:
    worker_id: str
    line: str


@dataclass(frozen=True)
class NetworkQuiet(StallWarning):
    """Every heartbeat stopped at once (blackout.py): ``since`` is when (None: they are
    back, or the wait ran out), ``ended`` when beats last came back. The driver prints
    ``line`` as it prints a stall warning (no worker: ``worker_id`` is empty)."""
    since: float | None = None
    ended: float = 0.0


@dataclass(frozen=True)
class BeginStop:
    """SIGTERM/SIGINT to elasticrun: every worker stops at its next commit."""
    signal: int
    at: float


@dataclass(frozen=True)
class Stopped:
    """The stop is over: exit with ``code``; ``killed`` missed --stop-timeout."""
    code: int
    killed: tuple = ()


@dataclass(frozen=True)
class Notice:
    """Worth a warning and an event (``event`` with ``fields``, a tuple of pairs)."""
    line: str
    event: str
    fields: tuple = ()


@dataclass(frozen=True)
class Track:
    """Bookkeeping: what repeats.py decided about repeating faults."""
    repeats: Repeats


@dataclass(frozen=True)
class NoteCommit:
    """Bookkeeping: the newest commit and checkpoint workers reported (holders.py)."""
    commit: int
    durable: int


@dataclass(frozen=True)
class MarkHolderless:
    since: float | None


@dataclass(frozen=True)
class MarkStraggler:
    """Bookkeeping: a worker consistently slower than its peers was warned about (once)."""
    worker_id: str


@dataclass(frozen=True)
class Fail:
    reason: str               # the one line the user sees


@dataclass(frozen=True)
class Finish:
    round_id: int
    size: int


Action = Union[Spawn, Stop, Evict, HostFailed, Abort, Reform, Publish, Removed, RecordExit,
               StartFinishing, MarkShort, MarkFailureReport, Preempted, Unpreempt, Left,
               StallWarning, BeginStop, Stopped, Notice, Track, NoteCommit, MarkHolderless,
               MarkStraggler, Fail, Finish]       # what ``policy.decide`` returns


class PolicyTick(Protocol):
    """What the policy's steps in other modules (verdicts, holders, stragglers) read of
    the tick (``policy._Tick``) and the two ways they act on it."""

    job: Job
    facts: Facts
    limits: Limits
    now: float
    workers: dict[str, WorkerView]

    def emit(self, action: Action) -> None: ...

    def host_failed(self, wid: str, host: str, reason: str) -> None: ...


def evolve(job: Job, action: Action) -> Job:
    """The bookkeeping after ``action``; actions without bookkeeping leave it alone."""
    r = dataclasses.replace
    if isinstance(action, Spawn):
        return r(job, next_worker=max(job.next_worker, int(action.worker_id) + 1))
    if isinstance(action, Abort):
        return r(job, aborted=job.aborted | {action.round_id})
    if isinstance(action, HostFailed):
        return r(job, last_failure=action.reason)
    if isinstance(action, Reform):
        return r(job, phase=Phase.REFORMING) if job.phase is Phase.RUNNING else job
    if isinstance(action, Publish):
        return _published(job, action)
    if isinstance(action, RecordExit):
        if action.final:
            return r(job, final_codes={**job.final_codes, action.worker_id: action.code})
        if not job.admitted(action.worker_id):
            return job          # never a final worker: StartFinishing only asks kept rounds
        return r(job, failed_exits={**job.failed_exits, action.worker_id: action.code})
    if isinstance(action, StartFinishing):
        rounds = job.rounds
        if action.members:
            rounds = {**rounds, action.round_id: MemberIds(action.members)}
        finals = rounds.get(action.round_id, ())
        codes = {**job.final_codes, **{w: c for w, c in job.failed_exits.items() if w in finals}}
        return r(job, phase=Phase.FINISHING, final_round=action.round_id, rounds=rounds,
                 final_codes=codes)
    if isinstance(action, MarkShort):
        return r(job, short_since=action.since)
    if isinstance(action, MarkFailureReport):
        return r(job, failure_report_at=action.at)
    if isinstance(action, Preempted):
        return r(job, preempted={**job.preempted, action.host: action.at})
    if isinstance(action, Unpreempt):
        return r(job, preempted={h: t for h, t in job.preempted.items() if h != action.host})
    if isinstance(action, BeginStop):
        return r(job, stop_signal=action.signal, stop_at=action.at)
    if isinstance(action, NetworkQuiet):
        return r(job, quiet_since=action.since, quiet_ended=action.ended)
    return _evolve_more(job, action)


def _evolve_more(job, action):
    r = dataclasses.replace
    if isinstance(action, Track):
        return r(job, repeats=action.repeats)
    if isinstance(action, NoteCommit):
        return r(job, commit=max(job.commit, action.commit), durable=max(job.durable,
                                                                         action.durable))
    if isinstance(action, MarkHolderless):
        return r(job, holderless_since=action.since)
    if isinstance(action, Left) and action.commit is not None:
        return r(job, commit=max(job.commit, int(action.commit)))   # newer than its beats
    if isinstance(action, MarkStraggler):
        return r(job, stragglers=job.stragglers | {action.worker_id})
    return job


def _published(job, action):
    """The bookkeeping of a new round: O(members), keeping the last ROUNDS_KEPT rounds."""
    members = action.members
    ids = MemberIds(m.worker_id for m in members)
    rounds = {rid: kept for rid, kept in job.rounds.items()
              if rid > action.round_id - ROUNDS_KEPT or rid == job.final_round}
    rounds[action.round_id] = ids
    member_hosts = dict.fromkeys(m.host for m in members)
    before = set(job.host_order)
    order = [h for h in job.host_order if h in member_hosts]
    order += [h for h in member_hosts if h not in before]
    kept = list(rounds.values())
    return dataclasses.replace(
        job, phase=Phase.RUNNING, round_id=action.round_id, members=members, rounds=rounds,
        aborted=frozenset(rid for rid in job.aborted if rid in rounds),
        failed_exits={w: c for w, c in job.failed_exits.items() if any(w in k for k in kept)},
        resets=job.resets + (1 if job.round_id else 0), host_order=tuple(dict.fromkeys(order)),
        short_since=None)
