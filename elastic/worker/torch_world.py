"""The round as torch.distributed's default group, so code written for torchrun
(``dist.all_reduce``, DDP, ``dist.new_group``, libraries built on them) runs
inside a round unchanged.

Each round's groups (groups.py) are also installed as the default group: a
``RoundGroup`` is a ``dist.ProcessGroup`` whose collectives are Python methods
that forward to the round's gloo (or NCCL) backend and return a ``RoundWork``.
Its ``wait()`` waits in slices that watch the round's abort key (waiting.py):
a user's blocking ``dist.all_reduce`` whose peer died raises
WorkersDepartedError instead of blocking until the group's timeout.

Ending the round uninstalls the group and lets go of its backends; what
still holds the group (a DDP not yet moved to the next round) holds them until
it lets go too, and groups.py frees them once their work has drained. A
collective on an ended round's group raises WorkersDepartedError at once.

``current()`` is the seam for code that needs the round's group by name
(DDP's wrapper, a DeviceMesh for FSDP2): it changes identity every round.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from elastic import protocol
from elastic.exceptions import ElasticError, WorkersDepartedError
from elastic.worker import sliced, waiting
from elastic.worker.membership import in_round

if TYPE_CHECKING:
    from elastic.protocol import ControlStore
    from elastic.worker.groups import TrackedGroup
    from elastic.worker.membership import Membership


class RoundMember(waiting.RoundWaits, Protocol):
    """What a round's default group reads of the worker: its place in the round, the
    waits (waiting.RoundWaits), and a store connection of its own for the watcher
    of DDP's futures (abortable.py)."""

    membership: Membership | None

    def new_control_connection(self) -> ControlStore: ...

# What dist.* and DDP call on a group; each goes to the backend of its tensors' device
# (the coalesced *_tensor_coalesced ones, which gloo lacks, are below: _one_at_a_time).
COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
    "broadcast", "reduce", "gather", "scatter", "reduce_scatter", "_reduce_scatter_base",
    "alltoall", "alltoall_base", "barrier", "send", "recv", "recv_anysource",
)

# The torchrun variables a round sets (GROUP_* are torchrun's names for the host's).
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")


def _first_tensor(obj: object) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


class RoundWork(dist.Work):
    """A backend's work whose ``wait()`` is sliced and abort-aware."""

    def __init__(self, work: dist.Work, group: RoundGroup, what: str) -> None:
        super().__init__()
        self._work = work
        self._group = group
        self._what = what

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._group.wait(self._work, self._what)
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def get_future(self) -> torch.futures.Future[Any]:
        return self._work.get_future()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def _source_rank(self) -> int:
        return self._work._source_rank()

    def result(self) -> list[torch.Tensor]:
        return self._work.result()

    def synchronize(self) -> None:
        self._work.synchronize()

    def block_current_stream(self) -> None:
        self._work.block_current_stream()


class Works(dist.Work):
    """Several backend works as one: a coalesced collective the backend lacks (gloo has
    no ``allgather_into_tensor_coalesced``), issued one tensor at a time."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> Any:
        return next((w.exception() for w in self._works if not w.is_success()), None)

    def get_future(self) -> torch.futures.Future[Any]:
        return torch.futures.collect_all([w.get_future() for w in self._works])


class RoundGroup(dist.ProcessGroup):
    """One round's membership as a ``dist.ProcessGroup`` (rank, size, collectives)."""

    def __init__(self, worker: RoundMember, round_id: int, cpu: TrackedGroup,
                 device: TrackedGroup) -> None:
        m = in_round(worker.membership)
        super().__init__(m.rank, m.size)  # type: ignore[call-arg, arg-type]
        self.worker = worker
        self.round_id = round_id
        self._cpu: TrackedGroup | None = cpu    # None once the round ended
        self._device = device if device is not cpu else None
        self.backend_name = "nccl" if self._device is not None else "gloo"
        self.ended = False
        # Registered too, for what reaches the backends from C++ (DDP's logger,
        # functional collectives): the C++ group holds them until it is freed itself.
        types = dist.ProcessGroup.BackendType
        self._register_backend(torch.device("cpu"), types.GLOO, cpu.group)
        if self._device is not None:
            self._register_backend(torch.device("cuda"), types.NCCL, self._device.group)
        self._set_default_backend(types.NCCL if self._device is not None else types.GLOO)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name, called from C++
        return self.backend_name

    def _backend_for(self, args: tuple[Any, ...]) -> TrackedGroup:
        cpu = self._cpu
        if self.ended or cpu is None:      # end() sets both
            raise WorkersDepartedError(f"round {self.round_id}'s process group has ended")
        tensor = _first_tensor(args)
        if tensor is not None and tensor.is_cuda and self._device is not None:
            return self._device
        return cpu

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work`` like our own collectives; an ended round's unfinished work
        is abandoned, as the round was."""
        if self.ended or self.worker.round_id != self.round_id:
            if work.is_completed() and work.is_success():
                return
            raise WorkersDepartedError(f"{what} abandoned: round {self.round_id} has ended")
        waiting.wait(work, what, self.worker)

    def end(self) -> None:
        """Drop the backends: a later collective raises, and groups.py can free them."""
        self.ended = True
        self._cpu = self._device = None


def _forward(name: str, backend_name: str | None = None) -> Callable[..., RoundWork]:
    def collective(self: RoundGroup, *args: Any, **kwargs: Any) -> RoundWork:
        work = getattr(self._backend_for(args), backend_name or name)(*args, **kwargs)
        self.worker.progress.issue()
        return RoundWork(work, self, name)

    collective.__name__ = name
    return collective


for _name in COLLECTIVES:
    setattr(RoundGroup, _name, _forward(_name))
# dist.all_gather_single / reduce_scatter_single (FSDP2's collectives) call these names,
# which a backend knows by its older ones: forwarded here, their waits are sliced too.
for _name, _backend_name in (("all_gather_single", "_allgather_base"),
                             ("reduce_scatter_single", "_reduce_scatter_base")):
    setattr(RoundGroup, _name, _forward(_name, _backend_name))



def _one_at_a_time(name: str, single: str) -> Callable[..., RoundWork]:
    """``name`` (a coalesced collective: lists of outputs and inputs) through the backend's
    own when it has one, else ``single`` per pair. DTensor's ``full_tensor()`` and
    redistributions reach gloo this way (functional collectives)."""
    def collective(self: RoundGroup, outputs: list[Any], inputs: list[Any], *args: Any,
                   **kwargs: Any) -> RoundWork:
        backend = self._backend_for((outputs, inputs))
        if hasattr(backend.group, name):
            work = getattr(backend, name)(outputs, inputs, *args, **kwargs)
        else:
            work = Works([getattr(backend, single)(out, inp, *args, **kwargs)
                          for out, inp in zip(outputs, inputs)])
        self.worker.progress.issue()
        return RoundWork(work, self, name)

    collective.__name__ = name
    return collective


for _name, _single in (("allgather_into_tensor_coalesced", "_allgather_base"),
                       ("reduce_scatter_tensor_coalesced", "_reduce_scatter_base")):
    setattr(RoundGroup, _name, _one_at_a_time(_name, _single))


_current: RoundGroup | None = None
_ended: RoundGroup | None = None     # the last round's, still known to torch (see uninstall)


class _AnyRank(dict[int, int]):
    """An ended group's rank map: torch's error logging asks it for this process's rank
    in the new round, which must not turn WorkersDepartedError into a ValueError."""

    def __contains__(self, rank: object) -> bool:
        return True

    def __missing__(self, rank: int) -> int:
        return rank


def current() -> RoundGroup | None:
    """The default group of the round this process is in, or None between rounds."""
    return _current


def install(worker: RoundMember, round_id: int, cpu: TrackedGroup, device: TrackedGroup,
            rendezvous: dist.Store) -> RoundGroup:
    """Make the round's groups torch.distributed's default group, and set the
    torchrun variables to describe the round."""
    global _current
    uninstall()
    group = RoundGroup(worker, round_id, cpu, device)
    name = f"elastic_round_{round_id}"
    group._set_group_name(name)  # type: ignore[arg-type]
    group._set_group_desc("default_pg")
    c10d._update_default_pg(group)
    # dist.new_group names groups by a per-process count: a newcomer's count and its
    # peers' must agree (torch resets it the same way when the default group goes).
    c10d._world.group_count = 0
    # dist.new_group meets its peers under this store (a prefix of the round's own).
    c10d._register_pg_in_world(group, backend_name=group.backend_name,
                               store=dist.PrefixStore("torch/", rendezvous), group_name=name,  # type: ignore[arg-type]
                               backend_config=group.backend_name,
                               rank_mapping={r: r for r in range(group.size())})
    _current = group
    os.environ.update(torchrun_env(in_round(worker.membership), os.environ))
    return group


def uninstall(group: RoundGroup | None = None) -> None:
    """End the installed round's default group (only ``group``'s, when given), and
    every group ``dist.new_group`` made in it: none of them may keep connections open."""
    global _current, _ended
    if _current is None or (group is not None and group is not _current):
        return
    _ended, _current = _current, None
    _ended.end()
    for pg in list(c10d._world.pg_map):
        if pg is not _ended:
            c10d._cleanup_process_group_global_state(pg)
    # The ended group stays known to torch until the next round ends (one group, not
    # one per round): dist.all_reduce(t, group=ended) then raises WorkersDepartedError,
    # where torch's error logging would otherwise raise a ValueError of its own.
    c10d._world.pg_group_ranks[_ended] = _AnyRank()
    c10d._update_default_pg(None)


def uninstall_using(groups: Iterable[TrackedGroup | None]) -> None:
    """End the installed default group if it runs on one of ``groups`` (retired)."""
    group = _current
    if group is not None and any(g is not None and (g is group._cpu or g is group._device)
                                 for g in groups):
        uninstall(group)


def torchrun_env(membership: Membership, environ: Mapping[str, str]) -> dict[str, str]:
    """The torchrun variables for ``membership``. MASTER_ADDR/PORT are the job's store,
    through which the round's group met (as torchrun's do)."""
    m = membership
    return {"RANK": str(m.rank), "WORLD_SIZE": str(m.size), "LOCAL_RANK": str(m.local_rank),
            "LOCAL_WORLD_SIZE": str(m.local_size), "GROUP_RANK": str(m.cross_rank),
            "GROUP_WORLD_SIZE": str(m.cross_size), "ROLE_RANK": str(m.rank),
            "ROLE_WORLD_SIZE": str(m.size),
            "MASTER_ADDR": environ.get(protocol.ENV_ADDR, "127.0.0.1"),
            "MASTER_PORT": environ.get(protocol.ENV_PORT, "0")}


ABORT_GRACE_S = 5.0    # how long an unexplained error waits for its round's abort


def explains(exc: BaseException, worker: RoundMember | None) -> bool:
    """Whether ``exc``, raised by user code in a round, means a peer departed: a
    torch.distributed error, our own error passed through a C++ future (DDP's
    backward), or anything at all once the round is aborted.

    A gloo error can reach us (within milliseconds of a peer's death) before the
    driver aborts the round, and may not say it is one (a library re-raises it as
    its own), so any other error waits up to ABORT_GRACE_S for the abort before it
    counts as the script's own and ends the worker."""
    if worker is None or isinstance(exc, ElasticError):
        return False     # ours say what they mean (WorkersDepartedError is caught before)
    chain, seen = exc, 0
    while chain is not None and seen < 8:
        if isinstance(chain, (dist.DistError, WorkersDepartedError)) or \
                "WorkersDepartedError" in str(chain):
            return True
        chain, seen = chain.__cause__ or chain.__context__, seen + 1  # type: ignore[assignment]
    member = worker

    def aborted_now() -> bool:
        if member.membership is None:
            raise LookupError("no round to wait on")
        return member.round_aborted()
    try:
        sliced.wait_sliced(aborted_now, sliced.never_aborted, ABORT_GRACE_S,
                           "the wait for the round's abort")
        return True
    except Exception:  # noqa: BLE001 - no abort in time, no round, or the store unreadable
        return False
