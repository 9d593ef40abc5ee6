"""A round's process groups: built so that an abort can interrupt the wait, tracked,
and freed once nothing can still touch them.

Each round gets fresh groups under a round-scoped PrefixStore, so a worker from
an older round can never reach a newer one (fencing by construction).

Each gloo group holds about 5 fds and 3 threads per rank, so a long job must
not keep every past round's group. Freeing one is safe only once no work
issued on it is still running: its destructor waits for that work, and a
collective abandoned on an aborted round may still wait on a peer. So every
group records the work issued on it (``TrackedGroup``), and a retired group is
released as soon as all its work has completed.

Work abandoned on an aborted round drains by itself: a peer that leaves the
round releases its own, idle group at once, which closes its connections,
which fails the work still waiting on it ("Connection closed by peer", within
milliseconds). The group's timeout is the backstop for a peer that never
closes (a stopped process is killed by the driver, which closes them too).
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastic import protocol
from elastic.exceptions import WorkersDepartedError
from elastic.worker import devices, nccl, torch_world, waiting
from elastic.worker.membership import Membership, in_round
from elastic.worker.sliced import AbortWatch, wait_sliced

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend as C10dBackend  # gloo's, NCCL's

    from elastic.worker.torch_world import RoundMember

def has_future(work: dist.Work) -> bool:
    """Whether ``work`` has a future, and with it an ``is_completed`` that turns True."""
    try:
        work.get_future()
    except RuntimeError:
        return False
    return True


class WaitedWork(dist.Work):
    """Work without a future, done once a ``wait()`` on it has returned.

    gloo's ``_reduce_scatter_base`` (FSDP2's reduce-scatter) returns such work: its
    ``is_completed()`` stays False even after it finished. Tracked as it is, every one
    would be kept with its tensors for the group's life, and the group would never
    drain; a wait is the only sign that it ended, so this records it.
    """

    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        self._work = work
        self._ended = False
        self._ok = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self._work.wait()
            self._ok = True
        finally:
            self._ended = True
        return True

    def is_completed(self) -> bool:
        return self._ended

    def is_success(self) -> bool:
        return self._ok

    def get_future(self) -> torch.futures.Future[Any]:
        return self._work.get_future()    # raises, as the work's own does


class TrackedGroup:
    """A process group that remembers its unfinished work.

    Forwards every method of the wrapped group; work objects it returns are
    recorded. ``group`` is the wrapped torch process group.
    """

    def __init__(self, group: C10dBackend, abortable: bool = False) -> None:
        self.group = group
        self.abortable = abortable   # NCCL: its stuck work ends only when it is aborted
        self._works: list[dist.Work] = []
        self._mu = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.group, name)
        if not callable(attr):
            return attr

        def issue(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            if isinstance(result, dist.Work):
                result = self._record(result)
            return result

        return issue

    def _record(self, work: dist.Work) -> dist.Work:
        # Completed work goes at once: a work object keeps its tensors alive.
        if not has_future(work):
            work = WaitedWork(work)
        with self._mu:
            self._works = [w for w in self._works if not w.is_completed()]
            self._works.append(work)
        return work

    def drained(self) -> bool:
        """True once no work issued on this group is still running."""
        with self._mu:
            self._works = [w for w in self._works if not w.is_completed()]
            return not self._works

    def pending(self) -> int:
        with self._mu:
            return sum(1 for w in self._works if not w.is_completed())


class RetiredGroups:
    """Groups of rounds this worker left, until their work has drained."""

    def __init__(self) -> None:
        self._groups: list[TrackedGroup] = []
        self.released = 0        # groups freed so far
        self.waited = 0          # groups that still had work in flight when retired

    def retire(self, *groups: TrackedGroup | None) -> None:
        torch_world.uninstall_using(groups)     # no default group keeps them alive
        for group in groups:
            if group is not None and all(group is not g for g in self._groups):
                self._groups.append(group)
                if not group.drained():
                    self.waited += 1
                    if group.abortable:      # a GPU stream blocked on a dead peer
                        nccl.abort(group.group)

    def release_drained(self) -> int:
        """Drop every retired group whose work has all completed; returns how many are left.

        The last reference goes here, so the group's destructor runs on this
        thread, and it returns at once: nothing is left for it to wait on.
        """
        if not self._groups:
            return 0
        keep = []
        for group in self._groups:
            if group.drained():
                self.released += 1
            else:
                keep.append(group)
        self._groups = keep
        return len(keep)

    def __len__(self) -> int:
        return len(self._groups)


def placement_for(membership: Membership) -> devices.Placement:
    """Where this worker's data plane runs in a round (devices.py); a PlacementError
    repeats on every round, so it is raised as it is, never as a departed peer."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return devices.place(os.environ.get(protocol.ENV_BACKEND, "auto"), membership.local_rank,
                         membership.local_size, count, membership.hostname)


def form_groups(watch: AbortWatch, rendezvous: dist.Store, rank: int, size: int,
                placement: devices.Placement, what: str) -> tuple[TrackedGroup, TrackedGroup]:
    """(cpu group, device group) of ``size`` ranks met through ``rendezvous``, built
    off-thread so that an abort of ``watch``'s round interrupts the wait.

    Raises WorkersDepartedError when the round is aborted or a peer never
    connects, PlacementError for an error that would repeat on every try. The
    device group is the cpu group when NCCL is not in use; an NCCL group is
    created eagerly, bound to its device, with a finite timeout.
    """
    timeout = timedelta(seconds=watch.collective_timeout)
    result: dict[str, Any] = {}

    def build() -> None:
        try:
            result["cpu"] = dist.ProcessGroupGloo(
                dist.PrefixStore("gloo/", rendezvous), rank, size, timeout)
            if placement.device is not None:
                torch.cuda.set_device(placement.device)     # this builder thread too
            if placement.backend == "nccl":
                result["device"] = nccl.new_group(dist.PrefixStore("nccl/", rendezvous), rank,
                                                  size, placement.cuda_device,
                                                  watch.collective_timeout)
        except Exception as exc:  # noqa: BLE001 - reported to the waiting thread
            result["error"] = exc

    builder = threading.Thread(target=build, name="elastic-group-build", daemon=True)
    builder.start()
    wait_sliced(lambda: not builder.is_alive(), watch.round_aborted, watch.collective_timeout,
                what, sleep=builder.join, gave_up=f"{what} did not form")
    if "error" in result:
        if devices.is_repeating_error(result["error"]):
            raise devices.PlacementError(f"{what}: {result['error']}")
        raise WorkersDepartedError(f"{what}: {result['error']}")
    cpu = TrackedGroup(result["cpu"])
    if "device" not in result:
        return cpu, cpu
    return cpu, TrackedGroup(result["device"], abortable=True)


def build_groups(worker: RoundMember, round_id: int,
                 placement: devices.Placement,
                 rendezvous: dist.Store) -> tuple[TrackedGroup, TrackedGroup]:
    """(cpu group, device group) of ``worker``'s membership in ``round_id``, met
    through ``rendezvous`` (the round's SignedStore), checked usable by every peer,
    and installed as torch.distributed's default group (torch_world.py)."""
    m = in_round(worker.membership)
    cpu, device = form_groups(worker, rendezvous, m.rank, m.size, placement,
                              f"process group for round {round_id}")
    # A group is usable only once every peer finished connecting: without this
    # a peer that returns at once (and exits) breaks the others' set-up.
    probe = torch.zeros(1)
    work = waiting.issue(lambda: cpu.allreduce([probe]), f"process group for round {round_id}")
    # round_aborted() reads worker.round_id, which is already this round.
    waiting.wait(work, "group check", worker)
    torch_world.install(worker, round_id, cpu, device, rendezvous)
    return cpu, device
