"""The worker process's side of the job: its connections, reports, leaving, the
heartbeat, and the module-level API (init, rank, size...).

How it follows the driver's rounds (join, assemble, enter, heal) is rounds.py's
``RoundLifeCycle``, which ``Worker`` extends. Every wait is bounded and watches
the round's abort key (sliced.py). See docs/architecture.md for a round's life.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any, NoReturn

from elastic import protocol as control
from elastic.exceptions import HostsUpdatedInterrupt, StopTraining, WorkersDepartedError
from elastic.protocol import ControlError, ControlStore, Keys, env_float
from elastic.worker import commits, logs
from elastic.worker.commits import CommitCheck
from elastic.worker.driver_contact import DriverContact, driver_grace
from elastic.worker.exit_guard import ExitGuard
from elastic.worker.liveness import CONNECT_TIMEOUT_S, BeatLink, Heartbeat, LeavingReport, Progress
from elastic.worker.membership import Membership, in_round
from elastic.worker.rounds import RoundLifeCycle

log = logging.getLogger(__name__)
logs.install()


class Worker(RoundLifeCycle):
    """One process of an elasticrun job: its connections, reports, leaving and heartbeat;
    the round life cycle is RoundLifeCycle's (rounds.py)."""

    beats_on_own_thread = True    # make scale beats for many workers from one thread

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
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
        self._init_rounds(size_hint=int(env.get(control.ENV_SIZE) or 1))
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

    def new_control_connection(self, timeout: float | None = None,
                               reconnect_within_s: float = control.RECONNECT_WITHIN_S) -> ControlStore:
        store = control.open_link(*self.driver_at, timeout or self.store_timeout,
                                  reconnect_within_s, warn=log.warning)   # heals after a reset
        return ControlStore(store, self._secret, warn=lambda msg: log.warning(msg))

    def beat_status(self) -> dict[str, Any]:
        """What each heartbeat carries: progress, and the rounds an adopting driver reads."""
        return dict(self.progress.report(), leaving=self.leave_requested,
                    round=self.round_id, latest=self._latest)

    @property
    def polls_work(self) -> bool:
        """NCCL work must be polled: its future completes when the kernel is queued."""
        return self.placement is not None and self.placement.wait_mode == "poll"

    def abort_device_group(self) -> None:
        """Abort this round's NCCL communicators (a stream blocked on a dead peer hangs)."""
        if self.device_group is not None and self.device_group.abortable:
            from elastic.worker import nccl
            nccl.abort(self.device_group.group)

    def report_failure(self, error: object = "") -> None:
        """Our own sealed report with ``error`` (kept until the next round), plus a doorbell;
        none where we only gave up a wait because the round was over (rounds.round_aborted)."""
        if self.round_id and self.round_id != self.over_round:
            try:
                key = Keys.failed(self.round_id, self.worker_id)
                self.control.put(key, {"round": self.round_id, "error": str(error)[-2000:]}, keep=True)
                self._standing.add(key)
                self.control.put(Keys.failures(self.round_id), {"worker": self.worker_id})
            except Exception:  # noqa: BLE001 - the driver notices by other means
                pass

    def report_pause(self, seconds: float) -> None:
        if self.membership is not None and self.membership.rank == 0:
            self.contact.put_news(Keys.pause(self.round_id), {"seconds": round(seconds, 4)})

    def report_progress(self, values: Mapping[str, Any]) -> None:
        self.contact.put_news(Keys.progress(self.worker_id),
                              dict(values, round=self.round_id, at=time.time()))

    def report_done(self) -> None:
        self.control.put(Keys.done(self.worker_id), {"round": self.round_id})

    def stop_requested(self) -> bool:
        """True once elasticrun published its stop (SIGTERM/SIGINT to it)."""
        try:
            return self.contact.news(Keys.STOP) is not None
        except ControlError:
            return False      # a forged value is ignored, never obeyed

    def request_leave(self, signum: int) -> None:
        """SIGTERM to this worker: leave at the next commit, as a graceful removal does."""
        self.leave_requested = int(signum)
        self.heartbeat.wake()      # tell the driver now, from the heartbeat's connection

    def commit_flags(self) -> CommitCheck:
        """What this rank brings to the commit's collective check.

        Only rank 0 looks at the store: the collective (a Max) hands its answer to
        every rank, so a commit costs the store two looks, not two per rank."""
        self.retired_groups.release_drained()
        self._leave_flagged = self.leave_requested
        looks = self.membership is None or self.membership.rank == 0
        latest = self.latest_round() if looks else 0
        return CommitCheck(pending_round=latest if latest > self.round_id else 0,
                           leaving=bool(self._leave_flagged),
                           stopping=bool(looks and self.stop_requested()))

    def agree_on_commit(self) -> CommitCheck:
        """The commit's collective check: every rank gets the same CommitCheck."""
        if self.membership is None:
            self.join_next_round()        # a commit between rounds joins one first
        flags, group = self.commit_flags(), self.cpu_group
        if group is None:                 # joining formed it: only a round left has none
            raise WorkersDepartedError(f"round {self.round_id} has no process group left")
        return commits.agree(flags, group, self)

    def act_on_commit(self, check: CommitCheck, commit: int) -> CommitCheck:
        """Every rank got the same ``check``, so every rank acts alike: raises StopTraining
        to stop or leave, HostsUpdatedInterrupt to re-form; returns ``check`` when training
        goes on. A SIGTERM that arrived during the collective waits for the next commit:
        peers did not hear of it at this one, and leaving now would break their next
        collective."""
        self.learn_latest(check.pending_round)   # rank 0's newest round: no read to join it
        if check.stopping:
            raise StopTraining(f"elasticrun is stopping; stopped at commit {commit}")
        if self._leave_flagged:
            self._announce_leaving(commit)
            raise StopTraining(f"signal {self.leave_requested}: left the job at commit {commit}")
        if check.reforms:
            raise HostsUpdatedInterrupt()
        return check

    def leaves_at(self, check: CommitCheck) -> bool:
        """Whether this worker leaves the job at the commit that agreed on ``check``: it
        got SIGTERM, or the round it re-forms into (already published) does not name it.
        A plan not readable yet counts as staying."""
        if check.stopping or not check.reforms:
            return False
        if self._leave_flagged:
            return True
        if not check.pending_round:
            return False
        header = self.control.get(Keys.plan(check.pending_round))
        return header is not None and \
            not control.RoundPlan.from_json(header).contains(self.worker_id)

    def check_commit(self, commit: int) -> CommitCheck:
        """Agree on the commit numbered ``commit`` and act on it (see act_on_commit)."""
        return self.act_on_commit(self.agree_on_commit(), commit)

    def _announce_leaving(self, commit: int | None = None) -> None:
        try:
            self._leaving.put(self.contact.quiet_connection(), commit)
        except Exception:  # noqa: BLE001 - the heartbeat said so already
            pass

    def _check_stop(self) -> None:
        """Between rounds: a stop or a leave request ends the worker here."""
        if self.leave_requested:
            self._announce_leaving()
            raise StopTraining(f"signal {self.leave_requested}: left the job between rounds")
        if self.stop_requested():
            raise StopTraining("elasticrun is stopping; stopped between rounds")

    def leave_process(self, why: str) -> NoReturn:
        """Not in the job any more: end this process (exit 0)."""
        log.info(why)
        self.stop()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def stop(self) -> None:
        self.heartbeat.stop()

    def store_stats(self) -> tuple[int, int]:
        """(requests, bytes read) on this worker's store connections so far."""
        beats = self.heartbeat.store_stats()
        return self.control.requests + beats[0], self.control.bytes_read + beats[1]


# -- module-level API ----------------------------------------------------------
_worker: Worker | None = None
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


def _install_leave_on_sigterm() -> None:
    """SIGTERM (a preempted pod, a spot reclaim) becomes a graceful leave at the next
    commit. Signal handlers can only be set from the main thread; elsewhere SIGTERM
    keeps its default and the worker counts as failed."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum: int, _frame: FrameType | None) -> None:
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
    """The current Worker, or None standalone or before ``init()``. A getter: it never
    connects or joins (``ensure_joined`` is the entry point that does)."""
    return _worker


def ensure_joined() -> Worker | None:
    """The entry point of everything that needs a round: ``init()`` (connect), then
    join one if this worker is between rounds. None standalone."""
    init()
    w = _worker
    if w is not None and w.membership is None:
        w.join_next_round()
    return w


def membership() -> Membership:
    w = ensure_joined()
    return in_round(w.membership) if w is not None else _STANDALONE


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
