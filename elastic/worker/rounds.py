"""A worker's round life cycle: join, assemble, enter, heal, leave the round.

A worker follows the driver's rounds (docs/architecture.md, "A round's life"): it
registers, waits for a plan that names it (``join_next_round``), reads its own
entry (``_try_round``), puts its arrival and waits for the driver's word that
every member arrived (``_assemble``), builds and checks the round's process
groups (``_enter``, groups.py), and keeps its sealed values readable while it
waits (``_heal_kept``). Every wait is bounded and watches the round's abort
(``round_aborted``, the AbortWatch of sliced.py).

``RoundLifeCycle`` is the part of ``Worker`` (runtime.py) that does this. It
holds the round's state; what it needs of the rest of the worker is listed on
the class (the store connections, the timeouts, the progress it reports and the
stop check), so the life cycle reads in one place and runtime.py keeps the
process's concerns: connecting, reporting, leaving, the heartbeat.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

import torch

from elastic import protocol as control
from elastic.exceptions import ElasticError, WorkersDepartedError
from elastic.protocol import Assembled, Keys, Member, RoundPlan
from elastic.worker.groups import RetiredGroups, TrackedGroup, build_groups, placement_for
from elastic.worker.membership import Membership, in_round
from elastic.worker.signed_store import SignedStore

if TYPE_CHECKING:
    from elastic.protocol import ControlStore
    from elastic.worker.devices import Placement
    from elastic.worker.driver_contact import DriverContact
    from elastic.worker.liveness import Progress

SELF_ASSEMBLY_MAX = 64      # rounds up to this size: members also see each other arrive


class RoundLifeCycle:
    """Joins, assembles and enters rounds; holds the current round's groups.

    The round's state lives here (set by ``_init_rounds``). The rest of the worker
    provides what the annotations and declarations below name (``_check_stop()``
    raises StopTraining to leave).
    """

    # What the worker provides.
    worker_id: str
    control: ControlStore
    contact: DriverContact
    progress: Progress
    round_timeout: float
    collective_timeout: float
    leave_requested: int

    if TYPE_CHECKING:        # declared for the type checker; Worker (runtime.py) defines them
        @property
        def polls_work(self) -> bool: ...
        def abort_device_group(self) -> None: ...
        def new_control_connection(self, timeout: float | None = None,
                                   reconnect_within_s: float = ...) -> ControlStore: ...
        def report_failure(self, error: object = "") -> None: ...
        def leave_process(self, why: str) -> NoReturn: ...
        def _check_stop(self) -> None: ...

    def _init_rounds(self, size_hint: int) -> None:
        self.round_id = 0
        self.membership: Membership | None = None
        self.ever_member = False
        self.registered = False
        self.cpu_group: TrackedGroup | None = None
        self.device_group: TrackedGroup | None = None
        self.placement: Placement | None = None
        self.retired_groups = RetiredGroups()
        self._latest = 0
        self._size_hint = size_hint   # sets how often we look
        self._healed_at = 0.0
        self._standing: set[str] = set()   # our sealed reports kept in place until the next round
        # A round whose waits we gave up because it was over (aborted, or a member reported
        # a failure): no failure of our own to report (Worker.report_failure).
        self.over_round = 0
        self._rendezvous: SignedStore | None = None   # the forming round's, healed until it checks
        self._round_store: SignedStore | None = None  # the current round's (its keys go with it)

    def latest_round(self) -> int:
        """Only ever moves forward: an older (replayed) or unreadable value changes nothing."""
        value = self.contact.news(Keys.LATEST_ROUND)   # the driver away: no news
        if value is not None:
            self._latest = max(self._latest, int(value["round"]))
        return self._latest

    @property
    def known_latest(self) -> int:
        return self._latest

    def learn_latest(self, round_id: int) -> None:
        """A newer round rank 0 verified, from the commit's collective: joined without a read."""
        self._latest = max(self._latest, int(round_id))

    def round_aborted(self) -> bool:
        """Whether our round is over for the waits in it: the driver aborted it (a sealed
        abort; a forged one is ignored), or, in a round of at most SELF_ASSEMBLY_MAX members,
        a member reported a failed collective of it (its sealed ``Keys.failures``). A wait
        given up for that is no failure this worker saw: it reports none (``over_round``),
        so the driver's verdict on a repeated failure still counts only the members that saw
        one.

        A member that reports a failure has left the round (it restores and waits for the
        next one), so no collective of the round can complete. A survivor blocked on another
        survivor sees no error of its own; without the report it waited for the driver's
        abort, which comes only once the driver has seen the dead process exit (its exit
        poll, up to a tick later): a crash pause held one more slice of that wait. The extra
        look is made only in small rounds, where it costs the store little.

        While a new group forms, this is also when our rendezvous values are put
        back if something overwrote them: peers may still need them."""
        if self._rendezvous is not None:
            self._rendezvous.heal()
            self._heal_kept()
        if self.round_id <= 0:
            return False
        size = self.membership.size if self.membership is not None else self._size_hint
        if self.contact.news(Keys.abort(self.round_id)) is not None or \
                size <= SELF_ASSEMBLY_MAX and \
                self.contact.news(Keys.failures(self.round_id)) is not None:
            self.over_round = self.round_id
            return True
        return False

    def join_next_round(self) -> Membership:
        """Leave the current round and block until a newer one including us forms.

        Always follows the newest round: one published while we wait for an
        older one to assemble replaces it.
        """
        self._drop_groups()
        if not self.registered:
            self.control.put(Keys.ready(self.worker_id), {"pid": os.getpid()}, keep=True)
            control.Doorbell(self.control, Keys.REGISTERED).ring(self.worker_id)
            self._standing.add(Keys.ready(self.worker_id))
            self.registered = True
        deadline = time.monotonic() + self.round_timeout
        tried = self.round_id
        self.progress.begin_wait("next round", tried, on_peers=False)
        # A round known from the commit is joined at once (the commit looked at the stop).
        known = self._latest if self._latest > tried else None
        stop_looked = time.monotonic() if known else 0.0
        try:
            while True:
                if self.leave_requested or \
                        time.monotonic() - stop_looked >= control.backstop_pause(self._size_hint):
                    stop_looked = time.monotonic()   # the stop key is looked at less often
                    self._check_stop()
                self.retired_groups.release_drained()
                latest, known = known or self.latest_round(), None
                if latest > tried:
                    outcome = self._try_round(latest, deadline)
                    if outcome:
                        for key in self._standing:
                            self.control.forget(key)
                        self._standing.clear()
                        return in_round(self.membership)
                    if outcome is not None:
                        tried = latest  # not a member, or aborted; None: plan not readable yet
                    self.progress.begin_wait("next round", tried, on_peers=False)
                if time.monotonic() > deadline:
                    raise ElasticError(f"no new round within {self.round_timeout:.0f} s")
                self._heal_kept()          # our registration and failure report stay readable
                time.sleep(control.poll_pause(self._size_hint, 0, first=0.02))
        finally:
            self.progress.end_wait()

    def _try_round(self, round_id: int, deadline: float) -> bool | None:
        """True: joined. False: not for us (not a member, or aborted). None: the plan
        is not readable (yet): try again.

        A member reads only its own entry (it carries the size): reads do not grow with
        the job. The header (member id runs) only where the entry is missing ("not a
        member" or "not yet") and in small rounds, whose members see each other arrive."""
        entry = self.control.get(Keys.member(round_id, self.worker_id))
        me = None if entry is None else Member.from_json(entry)
        small = None
        if me is None or me.size <= SELF_ASSEMBLY_MAX:
            header = self.control.get(Keys.plan(round_id))
            if header is None:
                return None
            plan = RoundPlan.from_json(header)
            self._size_hint = plan.size
            if not plan.contains(self.worker_id):
                if self.ever_member:
                    self.leave_process(f"not a member of round {round_id}; leaving the job")
                return False
            if me is None:
                return None       # an outsider removed it: the driver puts it back
            small = plan.member_ids()
        self._size_hint = me.size
        try:
            return self._enter(round_id, self._size_hint, small, me, deadline)
        finally:   # the driver has read our arrival, or the round is over
            self.control.forget(Keys.joined(round_id, self.worker_id))

    def _assemble(self, round_id: int, size: int, deadline: float,
                  member_ids: Sequence[str] | None = None) -> bool:
        """Put our sealed arrival and wait for the driver's word that every member
        arrived; False if the round was aborted or replaced first.

        In a small round (``member_ids`` given) the members' arrivals are also looked at
        directly, saving the driver's tick (a 4-worker job's pause); in a big one that
        would be O(n) per look per worker."""
        keys = [Keys.joined(round_id, w) for w in member_ids or ()]
        self.control.put(Keys.joined(round_id, self.worker_id), {"round": round_id}, keep=True)
        control.Doorbell(self.control, Keys.arrivals(round_id)).ring(self.worker_id)
        # Kept values just written or read by the driver: no heal, and in a big round no
        # look either, until a pause has passed (the store's busiest moment).
        began = self._healed_at = time.monotonic()
        self.progress.begin_wait(f"round {round_id} assembly", round_id)
        looked = began
        if not keys:
            time.sleep(control.poll_pause(size, 0))
        while True:
            if keys and len(self.control.get_present(keys)) == len(keys):
                return True
            outcome = self.control.get(Keys.assembled(round_id))
            if outcome is not None:
                return Assembled.from_json(outcome).ok
            now = time.monotonic()
            if now - looked >= control.backstop_pause(size):
                # Rarer looks: the driver also says "not ok" on this key when it
                # aborts or replaces the round, so these are only a backstop.
                looked = now
                if self.contact.news(Keys.abort(round_id)) is not None:
                    return False
                if self.latest_round() > round_id:
                    outcome = self.control.get(Keys.assembled(round_id))
                    return outcome is not None and Assembled.from_json(outcome).ok
                self._check_stop()
            elif self.leave_requested:
                self._check_stop()
            if now > deadline:
                raise ElasticError(f"round {round_id} did not assemble in time")
            self._heal_kept()
            time.sleep(control.poll_pause(size, now - began))

    def _heal_kept(self) -> None:
        """Put back our kept values (registration, arrival, failure report) where
        something overwrote them; at most every protocol.backstop_pause of the round."""
        now = time.monotonic()
        if now - self._healed_at >= control.backstop_pause(self._size_hint) and \
                not self.contact.away:
            self._healed_at = now
            self.control.heal()

    def _enter(self, round_id: int, size: int, small: list[str] | None, me: Member,
               deadline: float) -> bool:
        if not self._assemble(round_id, size, deadline, small):
            return False
        self.round_id = round_id
        self.membership = Membership(
            rank=me.rank, size=size, local_rank=me.local_rank, local_size=me.local_size,
            cross_rank=me.cross_rank, cross_size=me.cross_size, hostname=me.host,
        )
        self.placement = placement_for(self.membership)
        if self.placement.device is not None:
            # The current CUDA device is per thread: set it where training runs.
            torch.cuda.set_device(self.placement.device)
        self._rendezvous = self._round_store = SignedStore(
            self.control, Keys.process_group(round_id), self.collective_timeout)
        try:
            self.progress.begin_wait("group set-up", round_id)
            self.cpu_group, self.device_group = self.form_groups(round_id)
        except WorkersDepartedError as exc:
            self.report_failure(exc)
            self._drop_groups()
            return False
        finally:
            self._rendezvous = None
        if not self.ever_member:
            self.membership.export()
        self.ever_member = True
        return True

    def form_groups(self, round_id: int) -> tuple[TrackedGroup, TrackedGroup]:
        """The round's (CPU group, device group), through its signing rendezvous."""
        placement, rendezvous = self.placement, self._rendezvous
        if placement is None or rendezvous is None:       # _enter sets both first
            raise ElasticError(f"round {round_id}'s groups form only while the worker enters it")
        return build_groups(self, round_id, placement, rendezvous)

    def _drop_groups(self) -> None:
        """Leave the round's groups without waiting for them to drain.

        A group whose work all finished is freed at once; one with work still
        in flight (an aborted round) is kept, so that the work never writes into
        freed memory and its destructor never blocks, and is freed once that
        work has drained (groups.py).
        """
        self.retired_groups.retire(self.cpu_group, self.device_group)
        self.cpu_group = self.device_group = None
        if self._round_store is not None:
            # The round is over: its rendezvous values would stay in the store forever
            # (a driver that is away takes its store along: nothing to delete, no wait).
            try:
                if not self.contact.away:
                    self._round_store.delete_mine()
            except Exception:  # noqa: BLE001 - the driver also drops old rounds' keys
                pass
            self._round_store = None
        self.membership = None
        self.retired_groups.release_drained()
