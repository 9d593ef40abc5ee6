"""Horovod's process sets: collectives among a subset of the ranks.

A process set gets its own gloo group (and NCCL group, on GPUs), built by its
members the first time they use it in a round. Registration is local, not a
collective: a newcomer that registers its sets at start-up, while the
survivors are already training, meets them without a global agreement.

Membership changes. Ranks name different workers after a change, so a set
given as a list of ranks is bound to the round it was added in; using it in a
later round raises ProcessSetStaleError on every member (re-add it in a reset
callback). A set given as a rule, ``ProcessSet(lambda size: [...])``, is
rebuilt from the rule at its first use in each new round.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist

from elastic.exceptions import ElasticError, WorkersDepartedError
from elastic.protocol import Keys
from elastic.worker import collectives, runtime
from elastic.worker.groups import form_groups
from elastic.worker.signed_store import SignedStore

if TYPE_CHECKING:
    import torch

    from elastic.worker.groups import TrackedGroup
    from elastic.worker.membership import Membership
    from elastic.worker.runtime import Worker

Rule = Callable[[int], Iterable[int]]     # the job's size -> the set's ranks


class ProcessSetStaleError(ElasticError):
    """A process set defined by ranks was used after a membership change."""


class ProcessSet:
    """A subset of ranks, given as a list of ranks or as a rule ``size -> ranks``."""

    def __init__(self, ranks_or_rule: Iterable[int] | Rule) -> None:
        self._rule: Rule | None = None
        self._fixed: list[int] | None = None     # exactly one of the two is set
        if callable(ranks_or_rule):
            self._rule = ranks_or_rule
        else:
            self._fixed = _checked_ranks(ranks_or_rule)
        self.process_set_id: int | None = None
        self._round: int | None = None         # the round the current binding belongs to
        self._ranks = self._fixed
        self._groups: tuple[TrackedGroup, TrackedGroup] | None = None   # (cpu, device) this round

    @property
    def ranks(self) -> list[int]:
        if self._rule is not None:
            return _checked_ranks(self._rule(runtime.size()))
        return list(self._fixed or ())

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank inside the set, or -1 when it is not a member."""
        ranks = self.ranks
        return ranks.index(runtime.rank()) if runtime.rank() in ranks else -1

    def included(self) -> bool:
        return runtime.rank() in self.ranks

    def reduce_async(self, tensor: torch.Tensor,
                     op: str) -> tuple[Any, torch.Tensor, str, int, Worker] | None:
        """DistributedOptimizer's bucket allreduce over this set, without the pre-op check
        (every member launches the same buckets in the same order). Returns a handle for
        ``collectives.synchronize``, or None on a rank outside the set, whose gradients
        stay its own. A set defined by ranks raises ProcessSetStaleError after a
        membership change, on members and non-members alike."""
        w = runtime.ensure_joined()
        if w is None:
            return None
        if self._rule is None and self.process_set_id is not None and self._round != w.round_id:
            _bind_in(w, self)                # raises ProcessSetStaleError
        if not self.included():
            return None
        binding = _bind_in(w, self)
        opts = dist.AllreduceOptions()
        # torch's stubs type reduceOp as ReduceOp; it takes the RedOpType members (as in C++).
        opts.reduceOp = dist.ReduceOp.SUM if op == collectives.Average \
            else _REDUCE_OPS[op]  # type: ignore[assignment]
        group = binding.group_for(tensor)
        try:
            work = group.allreduce([tensor], opts)
        except Exception as exc:  # noqa: BLE001 - a failed launch means a peer is gone
            raise WorkersDepartedError(f"allreduce over {self!r} failed: {exc}") from exc
        w.progress.issue()
        return (work, tensor, op, binding.size, w)

    def __repr__(self) -> str:
        what = "rule" if self._rule else self._fixed
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={what})"


class _GlobalProcessSet(ProcessSet):
    """Every rank of the current round; its groups are the round's own."""

    def __init__(self) -> None:
        super().__init__(lambda size: list(range(size)))
        self.process_set_id = 0

    def __repr__(self) -> str:
        return "global_process_set"


global_process_set = _GlobalProcessSet()
_registered: dict[int, ProcessSet] = {0: global_process_set}
_REDUCE_OPS = {collectives.Sum: dist.ReduceOp.SUM, collectives.Min: dist.ReduceOp.MIN,
               collectives.Max: dist.ReduceOp.MAX, collectives.Product: dist.ReduceOp.PRODUCT}
_next_id = [1]
# (round, ranks) -> times built, so a re-added set gets a fresh prefix
_generations: dict[tuple[int, tuple[int, ...]], int] = {}
_lock = threading.Lock()


def _checked_ranks(ranks: Iterable[int]) -> list[int]:
    try:
        out = [int(r) for r in ranks]
    except TypeError:
        raise ValueError(f"a process set needs a list of ranks, not {ranks!r}") from None
    if not out or any(r < 0 for r in out) or len(set(out)) != len(out):
        raise ValueError(f"process set ranks must be distinct non-negative ints, got {out}")
    return sorted(out)


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Register a ProcessSet (or a list of ranks); returns the registered ProcessSet."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps!r} is already registered")
    ranks = ps.ranks
    if max(ranks) >= runtime.size():
        raise ValueError(f"process set ranks {ranks} exceed the job size {runtime.size()}")
    w = runtime.ensure_joined()
    current = w.round_id if w is not None else 0
    with _lock:
        for other in _registered.values():
            # A set of an older round is stale, so its ranks may be registered again.
            if other._rule is None and ps._rule is None and other._fixed == ranks \
                    and other._round == current:
                raise ValueError(f"a process set with ranks {ranks} is already registered")
        ps.process_set_id = _next_id[0]
        _next_id[0] += 1
        _registered[ps.process_set_id] = ps
    ps._round = current
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set; returns False when it was not registered (or is the global one)."""
    if process_set is global_process_set or process_set.process_set_id is None:
        return False
    with _lock:
        found = _registered.pop(process_set.process_set_id, None) is not None
    _retire(runtime.worker(), process_set)
    process_set.process_set_id = None
    return found


def _retire(w, ps):
    """Hand a set's groups to the worker's retired groups: freed once their work drains."""
    if ps._groups is not None and w is not None:
        w.retired_groups.retire(*ps._groups)
    ps._groups = None


def _retire_past_rounds(w):
    for ps in list(_registered.values()):
        if ps._groups is not None and ps._round != w.round_id:
            _retire(w, ps)


class Binding:
    """What an op needs to run on a set in the current round."""

    def __init__(self, worker: Worker, ranks: list[int], cpu_group: TrackedGroup,
                 device_group: TrackedGroup) -> None:
        self.worker = worker
        self.ranks = ranks
        self.size = len(ranks)
        self.rank = ranks.index(_in_round(worker)[0].rank) if worker else 0
        self.cpu_group = cpu_group
        self.device_group = device_group

    def group_for(self, tensor: torch.Tensor) -> TrackedGroup:
        return self.device_group if tensor.is_cuda else self.cpu_group

    def global_rank(self, set_rank: int) -> int:
        return self.ranks[set_rank]


def bind(process_set: ProcessSet | None = None) -> Binding | None:
    """Resolve ``process_set`` for the current round; None means standalone (size 1)."""
    ps = global_process_set if process_set is None else process_set
    if not isinstance(ps, ProcessSet):
        raise ValueError(f"process_set must be a ProcessSet, not {type(ps).__name__}")
    w = runtime.ensure_joined()
    return None if w is None else _bind_in(w, ps)


def _in_round(w: Worker) -> tuple[Membership, TrackedGroup, TrackedGroup]:
    """``w``'s place in its round and the round's (CPU, device) groups. They are set once
    ensure_joined() has returned ``w``: the run loop clears them only between rounds."""
    member, cpu, device = w.membership, w.cpu_group, w.device_group
    assert member is not None and cpu is not None and device is not None, "not in a round"
    return member, cpu, device


def _bind_in(w: Worker, ps: ProcessSet) -> Binding:
    """``ps`` in the round ``w`` has joined."""
    member, cpu, device = _in_round(w)
    if ps is global_process_set:
        if len(_registered) > 1:
            _retire_past_rounds(w)
        return Binding(w, list(range(member.size)), cpu, device)
    if ps.process_set_id is None:
        raise ValueError(f"{ps!r} is not registered: call add_process_set() first")
    if ps._rule is None and ps._round != w.round_id:
        _retire(w, ps)
        raise ProcessSetStaleError(
            f"process set {ps.process_set_id} (ranks {ps._fixed}) was defined in round "
            f"{ps._round}; the job's membership has changed since (now round {w.round_id}). "
            "Remove it and add it again in a reset callback, or define it by a rule: "
            "ProcessSet(lambda size: [...])")
    ranks = ps.ranks
    if member.rank not in ranks:
        raise ValueError(f"rank {member.rank} is not in {ps!r}; only its members may "
                         "run its collectives")
    if ps._groups is None or ps._round != w.round_id or ps._ranks != ranks:
        _retire(w, ps)
        ps._groups = _build(w, ranks)
        ps._round, ps._ranks = w.round_id, ranks
    return Binding(w, ranks, *ps._groups)


def _build(w, ranks):
    """Build the members' groups off-thread, so that an aborted round interrupts the wait."""
    key = (w.round_id, tuple(ranks))
    with _lock:
        generation = _generations.get(key, 0)
        _generations[key] = generation + 1
    scope = f"{Keys.process_group(w.round_id)}ps/{'-'.join(map(str, ranks))}/{generation}/"
    # Signed like the round's own rendezvous: an outsider cannot plant a peer address.
    store = SignedStore(w.control, scope, w.collective_timeout)
    return form_groups(w, store, ranks.index(w.membership.rank), len(ranks), w.placement,
                       f"process set {ranks} in round {w.round_id}")


def init(comm: None = None,
         process_sets: Iterable[ProcessSet] | Literal["dynamic"] | None = None) -> None:
    """Horovod's ``init(comm=None, process_sets=None)``.

    There is no MPI here, so ``comm`` must be None. ``process_sets`` (a list of
    ProcessSet, or "dynamic", which needs nothing here) are registered as by
    add_process_set. Sets need the job's size, so with them init() joins the
    first round at once, as ``rank()`` would.
    """
    if comm is not None:
        raise ValueError("init(comm=...) needs MPI, which elastic.torch does not use; "
                         "run under elasticrun instead")
    runtime.init()
    if process_sets is None or process_sets == "dynamic":
        return
    for ps in process_sets:
        add_process_set(ps)
