"""The worker's side of the job: membership, rounds and the heartbeat.

A worker follows the driver's rounds: it registers, waits for a plan that
names it, assembles with the round's other members and builds the round's
process groups (groups.py). Every wait is bounded and watches the round's
abort key (waiting.py). See docs/architecture.md for a round's life.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import torch

from elastic import protocol as control
from elastic.exceptions import ElasticError, HostsUpdatedInterrupt, StopTraining, WorkersDepartedError
from elastic.protocol import ControlError, ControlStore, Keys, env_float
from elastic.worker import logs
from elastic.worker.driver_contact import DriverContact, driver_grace
from elastic.worker.exit_guard import ExitGuard
from elastic.worker.groups import RetiredGroups, build_groups, placement_for
from elastic.worker.liveness import CONNECT_TIMEOUT_S, BeatLink, Heartbeat, LeavingReport, Progress
from elastic.worker.membership import Membership
from elastic.worker.signed_store import SignedStore

log = logging.getLogger(__name__)
logs.install()


SELF_ASSEMBLY_MAX = 64      # rounds up to this size: members also see each other arrive


class Worker:
    """One process of an elasticrun job."""

    beats_on_own_thread = True    # make scale beats for many workers from one thread

    def __init__(self, environ=None):
        """``environ``: the job's variables (make scale runs many workers per process)."""
        env = os.environ if environ is None else environ
        driver_pid = env.get(control.ENV_DRIVER_PID)
        if driver_pid and os.getppid() != int(driver_pid):
            # The driver died before the kernel could tie us to it (PDEATHSIG).
            log.error("elasticrun is gone; exiting")
            os._exit(1)
        self.worker_id = env[control.ENV_WORKER_ID]
        self.driver_at = (env[control.ENV_ADDR], int(env[control.ENV_PORT]))  # its store
        self._secret = control.read_secret_from_env(env)
        self.store_timeout = env_float(control.ENV_STORE_TIMEOUT, 60, env)
        self.round_timeout = env_float(control.ENV_ROUND_TIMEOUT, 900, env)
        self.collective_timeout = env_float(control.ENV_COLLECTIVE_TIMEOUT, 600, env)
        self.contact = DriverContact(self, driver_grace(env))   # joining mode: outlive the driver
        self.control = self.new_control_connection(
            reconnect_within_s=self.contact.reconnect_window(control.RECONNECT_WITHIN_S))
        self.round_id = 0
        self.membership = None
        self.ever_member = False
        self.registered = False
        self.cpu_group = None
        self.device_group = None
        self.placement = None
        self.retired_groups = RetiredGroups()
        self._latest = 0
        self._size_hint = int(env.get(control.ENV_SIZE) or 1)   # sets how often we look
        self._healed_at = 0.0
        self._standing = set()      # our sealed reports kept in place until the next round
        self._rendezvous = None     # the forming round's SignedStore, healed until it checks
        self._round_store = None    # the current round's SignedStore (its keys go with it)
        self.progress = Progress()
        self.leave_requested = 0     # the signal number once SIGTERM asked us to leave
        self._leave_flagged = 0      # ... as this rank's commit flags told its peers
        self._leaving = LeavingReport(self.worker_id, lambda: self.leave_requested)
        self.heartbeat = Heartbeat(BeatLink(
            worker_id=self.worker_id, driver_at=self.driver_at, contact=self.contact,
            connect=lambda: self.new_control_connection(timeout=CONNECT_TIMEOUT_S,
                                                        reconnect_within_s=0),
            status=self.beat_status, leave_requested=lambda: self.leave_requested,
            leaving=self._leaving), env_float(control.ENV_HEARTBEAT_INTERVAL, 1.0, env))
        if self.beats_on_own_thread:
            self.heartbeat.first_beat()
            self.heartbeat.start()

    def new_control_connection(self, timeout=None, reconnect_within_s=control.RECONNECT_WITHIN_S):
        store = control.open_link(*self.driver_at, timeout or self.store_timeout,
                                  reconnect_within_s, warn=log.warning)   # heals after a reset
        return ControlStore(store, self._secret, warn=lambda msg: log.warning(msg))

    def beat_status(self):
        """What each heartbeat carries: progress, and the rounds an adopting driver reads."""
        return dict(self.progress.report(), leaving=self.leave_requested,
                    round=self.round_id, latest=self._latest)

    # -- rounds ---------------------------------------------------------------
    def latest_round(self):
        """Only ever moves forward: an older (replayed) or unreadable value changes nothing."""
        value = self.contact.news(Keys.LATEST_ROUND)   # the driver away: no news
        if value is not None:
            self._latest = max(self._latest, int(value["round"]))
        return self._latest

    @property
    def known_latest(self):
        return self._latest

    def learn_latest(self, round_id):
        """A newer round rank 0 verified, from the commit's collective: joined without a read."""
        self._latest = max(self._latest, int(round_id))

    @property
    def polls_work(self):
        """NCCL work must be polled: its future completes when the kernel is queued."""
        return self.placement is not None and self.placement.wait_mode == "poll"

    def abort_device_group(self):
        """Abort this round's NCCL communicators (a stream blocked on a dead peer hangs)."""
        if self.device_group is not None and self.device_group.abortable:
            from elastic.worker import nccl
            nccl.abort(self.device_group.group)

    def round_aborted(self):
        """Whether the driver aborted our round (a sealed abort; a forged one is ignored).

        While a new group forms, this is also when our rendezvous values are put
        back if something overwrote them: peers may still need them."""
        if self._rendezvous is not None:
            self._rendezvous.heal()
            self._heal_kept()
        return self.round_id > 0 and self.contact.news(Keys.abort(self.round_id)) is not None

    def report_failure(self, error=""):
        """Our own sealed report with ``error`` (kept until the next round), plus a doorbell."""
        if self.round_id:
            try:
                key = Keys.failed(self.round_id, self.worker_id)
                self.control.put(key, {"round": self.round_id, "error": str(error)[-2000:]}, keep=True)
                self._standing.add(key)
                self.control.put(Keys.failures(self.round_id), {"worker": self.worker_id})
            except Exception:  # noqa: BLE001 - the driver notices by other means
                pass

    def report_pause(self, seconds):
        if self.membership is not None and self.membership.rank == 0:
            self.contact.put_news(Keys.pause(self.round_id), {"seconds": round(seconds, 4)})

    def report_progress(self, values):
        self.contact.put_news(Keys.progress(self.worker_id),
                              dict(values, round=self.round_id, at=time.time()))

    def report_done(self):
        self.control.put(Keys.done(self.worker_id), {"round": self.round_id})

    def stop_requested(self):
        """True once elasticrun published its stop (SIGTERM/SIGINT to it)."""
        try:
            return self.contact.news(Keys.STOP) is not None
        except ControlError:
            return False      # a forged value is ignored, never obeyed

    def request_leave(self, signum):
        """SIGTERM to this worker: leave at the next commit, as a graceful removal does."""
        self.leave_requested = int(signum)
        self.heartbeat.wake()      # tell the driver now, from the heartbeat's connection

    def commit_flags(self):
        """What this rank brings to the commit's collective check.

        Only rank 0 looks at the store: the collective (a Max) hands its answer to
        every rank, so a commit costs the store two looks, not two per rank."""
        self.retired_groups.release_drained()
        self._leave_flagged = self.leave_requested
        looks = self.membership is None or self.membership.rank == 0
        latest = self.latest_round() if looks else 0
        return [latest if latest > self.round_id else 0, 1 if self._leave_flagged else 0,
                1 if looks and self.stop_requested() else 0]

    def act_on_commit_flags(self, flags, commit):
        """Every rank got the same Max of the flags, so every rank acts alike. A SIGTERM
        that arrived during the collective waits for the next commit: peers did not hear
        of it at this one, and leaving now would break their next collective."""
        pending, leaving, stopping = flags
        self.learn_latest(pending)      # rank 0's newest round (0: none): no read to join it
        if stopping:
            raise StopTraining(f"elasticrun is stopping; stopped at commit {commit}")
        if self._leave_flagged:
            self._announce_leaving(commit)
            raise StopTraining(f"signal {self.leave_requested}: left the job at commit {commit}")
        if pending or leaving:
            raise HostsUpdatedInterrupt()

    def _announce_leaving(self, commit=None):
        try:
            self._leaving.put(self.contact.quiet_connection(), commit)
        except Exception:  # noqa: BLE001 - the heartbeat said so already
            pass

    def _check_stop(self):
        """Between rounds: a stop or a leave request ends the worker here."""
        if self.leave_requested:
            self._announce_leaving()
            raise StopTraining(f"signal {self.leave_requested}: left the job between rounds")
        if self.stop_requested():
            raise StopTraining("elasticrun is stopping; stopped between rounds")

    def join_next_round(self):
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
                        return self.membership
                    if outcome is not None:
                        tried = latest  # not a member, or aborted; None: plan not readable yet
                    self.progress.begin_wait("next round", tried, on_peers=False)
                if time.monotonic() > deadline:
                    raise ElasticError(f"no new round within {self.round_timeout:.0f} s")
                self._heal_kept()          # our registration and failure report stay readable
                time.sleep(control.poll_pause(self._size_hint, 0, first=0.02))
        finally:
            self.progress.end_wait()

    def _try_round(self, round_id, deadline):
        """True: joined. False: not for us (not a member, or aborted). None: the plan
        is not readable (yet): try again.

        A member reads only its own entry (it carries the size): reads do not grow with
        the job. The header (member id runs) only where the entry is missing ("not a
        member" or "not yet") and in small rounds, whose members see each other arrive."""
        me = self.control.get(Keys.member(round_id, self.worker_id))
        small = None
        if me is None or int(me["size"]) <= SELF_ASSEMBLY_MAX:
            plan = self.control.get(Keys.plan(round_id))
            if plan is None:
                return None
            self._size_hint = int(plan["size"])
            if not control.ids_contain(plan["ids"], self.worker_id):
                if self.ever_member:
                    self.leave_process(f"not a member of round {round_id}; leaving the job")
                return False
            if me is None:
                return None       # an outsider removed it: the driver puts it back
            small = control.decode_ids(plan["ids"])
        self._size_hint = int(me["size"])
        try:
            return self._enter(round_id, self._size_hint, small, me, deadline)
        finally:   # the driver has read our arrival, or the round is over
            self.control.forget(Keys.joined(round_id, self.worker_id))

    def _assemble(self, round_id, size, deadline, member_ids=None):
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
                return bool(outcome["ok"])
            now = time.monotonic()
            if now - looked >= control.backstop_pause(size):
                # Rarer looks: the driver also says "not ok" on this key when it
                # aborts or replaces the round, so these are only a backstop.
                looked = now
                if self.contact.news(Keys.abort(round_id)) is not None:
                    return False
                if self.latest_round() > round_id:
                    outcome = self.control.get(Keys.assembled(round_id))
                    return bool(outcome and outcome["ok"])
                self._check_stop()
            elif self.leave_requested:
                self._check_stop()
            if now > deadline:
                raise ElasticError(f"round {round_id} did not assemble in time")
            self._heal_kept()
            time.sleep(control.poll_pause(size, now - began))

    def _heal_kept(self):
        """Put back our kept values (registration, arrival, failure report) where
        something overwrote them; at most every protocol.backstop_pause of the round."""
        now = time.monotonic()
        if now - self._healed_at >= control.backstop_pause(self._size_hint) and \
                not self.contact.away:
            self._healed_at = now
            self.control.heal()

    def _enter(self, round_id, size, small, me, deadline):
        if not self._assemble(round_id, size, deadline, small):
            return False
        self.round_id = round_id
        self.membership = Membership(
            rank=me["rank"], size=size, local_rank=me["local_rank"], local_size=me["local_size"],
            cross_rank=me["cross_rank"], cross_size=me["cross_size"], hostname=me["host"],
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

    def form_groups(self, round_id):
        """The round's (CPU group, device group), through its signing rendezvous."""
        return build_groups(self, round_id, self.placement, self._rendezvous)

    def _drop_groups(self):
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

    def leave_process(self, why):
        """Not in the job any more: end this process (exit 0)."""
        log.info(why)
        self.stop()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def stop(self):
        self.heartbeat.stop()

    def store_stats(self):
        """(requests, bytes read) on this worker's store connections so far."""
        beats = self.heartbeat.store_stats()
        return self.control.requests + beats[0], self.control.bytes_read + beats[1]


# -- module-level API ----------------------------------------------------------
_worker = None
_initialized = False
_STANDALONE = Membership()


def init() -> None:
    """Connect to elasticrun, or become a single worker of size 1 outside it."""
    global _worker, _initialized
    if _initialized:
        return
    if os.environ.get(control.ENV_ADDR):
        _worker = Worker()
        _exit_guard.install()
        _install_leave_on_sigterm()
    _initialized = True


def _install_leave_on_sigterm():
    """SIGTERM (a preempted pod, a spot reclaim) becomes a graceful leave at the next
    commit. Signal handlers can only be set from the main thread; elsewhere SIGTERM
    keeps its default and the worker counts as failed."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum, _frame):
        w = _worker
        if w is None:
            raise SystemExit(128 + signum)
        if w.leave_requested:        # a second SIGTERM: go now
            os._exit(128 + signum)
        log.warning("signal %d: leaving the job at the next commit", signum)
        w.request_leave(signum)

    signal.signal(signal.SIGTERM, on_sigterm)


_exit_guard = ExitGuard(lambda: shutdown())


def is_initialized() -> bool:
    return _initialized


def shutdown() -> None:
    global _worker, _initialized
    if _worker is not None:
        _worker.stop()
        _worker = None
    _initialized = False


def current_membership() -> Membership | None:
    """The membership of the round this worker is in, or None; never joins or connects."""
    return _worker.membership if _worker is not None else None


def worker() -> Worker | None:
    """The current Worker, or None when running standalone."""
    init()
    return _worker


def ensure_joined() -> Worker | None:
    w = worker()
    if w is not None and w.membership is None:
        w.join_next_round()
    return w


def membership() -> Membership:
    w = ensure_joined()
    return w.membership if w is not None else _STANDALONE


def rank() -> int:
    return membership().rank


def size() -> int:
    return membership().size


def local_rank() -> int:
    return membership().local_rank


def local_size() -> int:
    return membership().local_size


def cross_rank() -> int:
    return membership().cross_rank


def cross_size() -> int:
    return membership().cross_size
