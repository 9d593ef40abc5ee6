"""Named async ops matched by name, as Horovod's coordinator matches them.

Ops normally agree in program order: each rank's record is exchanged with
its peers' and must describe the same op. Horovod instead matches ops by
name, so ranks may issue named async ops in different orders (one rank
issues ``allreduce_async(t, name="a")`` before a collective its peers issue
first). To allow that, every exchange also carries the op's mode and the
keys (op kind and name) of this rank's *pending* ops: named async ops
issued here that the peers had not issued yet. From the records alone every
member takes the same decision (``decide``, a pure function):

- RUN: all records name the same op: check and run it (the common case,
  one exchange per op, as before).
- FLUSH: some keys are pending or current on every member: run those ops,
  in the lowest member's order, each with its own checked exchange; a rank
  whose current op was not among them exchanges again.
- DEFER: otherwise ranks whose op is a named async op keep it pending and
  return its handle at once; the others exchange again with their next op.
- MISMATCH: nothing can wait: the error is raised on every member (where
  Horovod would hang).

A pending op runs when its peers issue it (inside their next exchange) or
when this rank synchronizes it. Unnamed ops match by order, as before.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from elastic.exceptions import WorkersDepartedError
from elastic.torch import negotiation
from elastic.torch.handles import Handle, release_name
from elastic.torch.negotiation import (
    JOIN,
    KEY,
    KIND,
    MAX_PENDING,
    MODE,
    NAME,
    NPEND,
    PEND,
    WAIT,
    CollectiveMismatchError,
    Outcome,
    record,
)

if TYPE_CHECKING:
    from elastic.torch.handles import NameKey
    from elastic.torch.negotiation import Record
    from elastic.torch.process_sets import Binding

Issue = Callable[[Outcome], Handle]     # starts an op's data movement once the records agree

BLOCKING, DEFERRABLE, WAITING = 0, 1, 2
RUN, FLUSH, DEFER, MISMATCH = "run", "flush", "defer", "mismatch"

_pending: dict[tuple[int, tuple[int, ...]], list[Op]] = {}   # (round, set ranks) -> oldest first
_lock = threading.Lock()


def op_key(what: str, rec: Record) -> int:
    """The key of an op: its kind and name; 0 when it has no name (matched by order)."""
    if not rec[NAME]:
        return 0
    digest = hashlib.blake2b(f"{what}|{rec[NAME]}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Op:
    """One op of this rank: its record, and how to issue it once the set agrees."""

    def __init__(self, binding: Binding, rec: Record, what: str, issue: Issue,
                 name_key: NameKey | None, vary_dim0: bool) -> None:
        self.binding, self.rec, self.what, self.issue = binding, rec, what, issue
        self.name_key, self.vary_dim0 = name_key, vary_dim0
        self.key = op_key(what, rec)
        self.handle: Deferred | None = None       # while pending

    def run(self) -> Handle:
        """The op's own checked exchange, then its data movement (same order everywhere)."""
        outcome = negotiation.negotiate(self.binding, list(self.rec), self.what, self.vary_dim0)
        if outcome.error is not None:
            return Handle.failed(outcome.error, self.name_key)
        return self.issue(outcome)


class Deferred(Handle):
    """The handle of a named async op that waits for its peers to issue it."""

    def __init__(self, op: Op) -> None:
        super().__init__(what=op.what)
        self._op = op
        self._inner: Handle | None = None

    def issued(self, inner: Handle) -> None:
        self._inner = inner

    def poll(self) -> bool:
        return self._inner is not None and self._inner.poll()

    def wait(self) -> Any:
        if self._inner is None:
            _wait_for(self._op)
        inner = self._inner
        assert inner is not None, "_wait_for() returns once the op was issued (or raises)"
        return inner.wait()


def _queue(binding):
    key = (binding.worker.round_id, tuple(binding.ranks))
    with _lock:
        for stale in [k for k in _pending if k[0] != key[0]]:
            for op in _pending.pop(stale):      # a past round: its ops can never run
                op.handle.issued(Handle.failed(WorkersDepartedError(
                    f"{op.what}: the round ended before the peers issued this named op"),
                    op.name_key))
        return _pending.setdefault(key, [])


def start(binding: Binding, rec: Record, what: str, issue: Issue, name_key: NameKey | None = None,
          vary_dim0: bool = False, deferrable: bool = False) -> Handle:
    """Agree on an op with the set's members and issue it; returns its handle.

    ``issue(outcome)`` starts the data movement once the records agree.
    """
    op = Op(binding, rec, what, issue, name_key, vary_dim0)
    mode = DEFERRABLE if deferrable and op.key else BLOCKING
    return _drive(op, mode)


def _wait_for(op):
    """synchronize() of a pending op: exchange until the set runs it (or cannot)."""
    _drive(op, WAITING)


def _drive(op, mode):
    queue = _queue(op.binding)
    while True:
        rec = list(op.rec) if mode != WAITING else record(WAIT, name=None)
        rec[MODE], rec[KEY] = mode, op.key
        if mode == WAITING:
            rec[NAME] = op.rec[NAME]
        keys = [p.key for p in queue[:MAX_PENDING]]
        if mode == WAITING and op.key not in keys:
            keys[-1] = op.key         # the op waited for is always on offer
        rec[NPEND] = len(keys)
        rec[PEND:PEND + len(keys)] = keys
        outcome = Outcome(negotiation.exchange(op.binding, rec))
        action, order = decide(outcome.records)
        if action == RUN and mode == WAITING:
            action = MISMATCH         # only with join(): a waited op is never run by order
        if action == RUN:
            negotiation.judge(outcome, op.binding, op.what, op.vary_dim0)
            if outcome.error is not None:
                return Handle.failed(outcome.error, op.name_key)
            return op.issue(outcome)
        if action == FLUSH:
            done = None
            for key in order:
                if key == op.key and mode != WAITING:
                    done = op.run()
                    continue
                pending = next(p for p in queue if p.key == key)
                queue.remove(pending)
                pending.handle.issued(pending.run())
                if pending is op:
                    done = op.handle
            if done is not None:
                return done
            continue
        if action == DEFER and mode == DEFERRABLE:
            op.handle = Deferred(op)
            queue.append(op)
            return op.handle
        if action == MISMATCH:
            error = _mismatch(outcome, op)
            if mode == WAITING:
                queue.remove(op)
                release_name(op.name_key)
                raise error
            return Handle.failed(error, op.name_key)
        # DEFER, and this rank's op cannot wait: exchange again with the others' next op


def decide(records: Sequence[Record]) -> tuple[str, list[int] | None]:
    """What the set does with one exchange of records (the same on every member)."""
    if any(int(r[KIND]) == JOIN for r in records):
        return RUN, None          # join() keeps the rules of ordered ops
    keys = {int(r[KEY]) for r in records}
    modes = [int(r[MODE]) for r in records]
    if len(keys) == 1 and WAITING not in modes:
        return RUN, None
    offers = []
    for r, mode in zip(records, modes):
        mine = [int(k) for k in r[PEND:PEND + int(r[NPEND])]]
        if int(r[KEY]) and mode != WAITING:
            mine.append(int(r[KEY]))
        offers.append(mine)
    common = set(offers[0]).intersection(*offers[1:])
    if common:
        return FLUSH, [k for k in offers[0] if k in common]
    if DEFERRABLE in modes:
        return DEFER, None
    return MISMATCH, None


def _mismatch(outcome, op):
    binding = op.binding
    waiting = [binding.global_rank(r) for r, rec in enumerate(outcome.records)
               if int(rec[MODE]) == WAITING]
    if not waiting:
        error = negotiation.check_records(outcome, binding, op.what, False)
        if error is not None:
            return error
    return CollectiveMismatchError(
        f"{op.what}: ranks {waiting or binding.ranks} wait in synchronize() for named async "
        "ops that their peers have not issued, while the peers run other collectives; "
        "issue the same named ops on every rank of the set")
