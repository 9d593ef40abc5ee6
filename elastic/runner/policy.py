"""The driver's decisions as data: ``decide(facts, now) -> [actions]``, a pure function.

Each tick the driver gathers facts (the job's bookkeeping, its workers, the
exits since the last tick, the host manager, a few store counters), asks
``decide`` what to do, and carries out the actions in order. The fact and
action types, and ``evolve`` (the one place the bookkeeping changes), live in
decisions.py; ``decide`` folds each action it emits into its own copy of the
job with ``evolve`` too, so later steps of a tick see what earlier ones did.

Nothing here does I/O, reads a clock or raises for a job that cannot go on
(that is a ``Fail`` action). To teach the driver something new: add a fact
field and an action in decisions.py, a step in ``_Tick``, a branch in
``Driver._carry_out``, and a case in tests/test_decide.py.

Cost at thousands of workers (issue 14): ``can_skip`` lets a quiet tick cost O(1);
a full tick is O(n) with small constants (no deep copies, no re-plan when the ready
workers are the current round), and a tick that re-plans is O(n log n).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from elastic.runner import blackout, holders, stragglers, verdicts
from elastic.runner.decisions import (
    Abort,
    Action,
    BeginStop,
    Evict,
    Exit,
    Facts,
    Fail,
    Finish,
    HostFailed,
    Job,
    Left,
    Limits,
    MarkShort,
    Notice,
    Phase,
    Preempted,
    Publish,
    RecordExit,
    Reform,
    Removed,
    Spawn,
    StallWarning,
    StartFinishing,
    Stop,
    Stopped,
    Unpreempt,
    WorkerView,
    evolve,
)
from elastic.runner.exits import ExitKind, classify_exit, final_outcome
from elastic.runner.planner import describe_change, plan_round, same_membership
from elastic.runner.stalls import StallView, describe, find_stalls, long_waits
from elastic.runner.verdicts import FAILURE_REPORT_GRACE_S  # noqa: F401 - tests read it here

JOIN_BATCH_S = 15.0            # newcomers still importing torch are awaited this long
JOIN_TOGETHER_S = 2.0          # ... if spawned this close after the first ready one: a
                               # later replacement (churn) does not hold back a ready one


def can_skip(job: Job, limits: Limits, now: float, *, settled_at: float | None,
             exits: Sequence[Exit], liveness_checked: bool, failure_reports: bool,
             newly_ready: int, unready: int, last_spawn_at: float | None, hosts_changed: bool,
             stop_signal: int | None) -> bool:
    """True only when ``decide`` would certainly return no action now: the driver may then
    skip gathering the full facts and calling it. O(1) (plus the few preempted hosts).

    The arguments describe what the driver saw since the last tick on which it ran decide:
      settled_at       when that decide ran, if it returned no action (None: it acted)
      exits            processes reaped this tick
      liveness_checked heartbeats were read this tick (the liveness and stall rules run)
      failure_reports  a failure report was seen (the current round's, or a replaced one's)
      newly_ready      workers whose ready key appeared since that decide
      unready          live workers neither ready nor stopped
      last_spawn_at    when the newest worker was started (None: none yet)
      hosts_changed    HostManager.version moved since that decide (discovery, a blacklisting,
                       or a cooldown that ``returning(now)``, called first, saw run out)
      stop_signal      SIGTERM/SIGINT to elasticrun
    Facts that move only on liveness ticks (heartbeats, progress, SIGTERM reports) or only
    through actions (the job, stopped workers) need no argument; nor does ``joined``, which
    only decides whether a publish aborts the round it replaces. The clock matters only
    through the rules below; every one of them is checked or rules the skip out.
    """
    if settled_at is None or now < settled_at:
        return False
    if exits or liveness_checked or failure_reports or newly_ready or hosts_changed:
        return False
    if stop_signal is not None or job.stop_signal is not None:
        return False                      # --stop-timeout runs
    if job.phase is not Phase.RUNNING and job.phase is not Phase.FINISHING:
        return False                      # starting and re-forming go on by the clock
    if job.short_since is not None or job.failure_report_at is not None \
            or job.holderless_since is not None:
        return False                      # --elastic-timeout, the failure-report grace, holders
    if unready and (last_spawn_at is None or settled_at - last_spawn_at < JOIN_BATCH_S):
        return False                      # a newcomer may stop counting as starting
    hold = limits.preempted_hold
    return all(now - since <= hold for since in job.preempted.values())


def decide(facts: Facts, now: float) -> list[Action]:
    """What the driver should do now, in order. Ends with Fail or Finish when the job ends."""
    tick = _Tick(facts, now)
    try:
        tick.run()
    except _Done:
        pass
    return tick.actions


class _Seat:
    """A planner candidate (what ``planner.Candidate`` holds) that is cheap to make."""

    __slots__ = ("worker_id", "host", "slot")

    def __init__(self, worker_id, host, slot):
        self.worker_id, self.host, self.slot = worker_id, host, slot


class _Done(Exception):
    """The tick ends early: the job failed or finished."""


class _Tick:
    """One tick's reasoning; ``job`` and ``workers`` track what the actions so far changed."""

    def __init__(self, facts, now):
        self.facts = facts
        self.limits = facts.limits
        self.now = now
        self.job = facts.job
        self.hosts = facts.hosts              # copied before the first blacklisting
        self._own_hosts = False
        self.workers = dict(facts.workers)
        self.pending = {e.worker_id: e for e in facts.exits}   # exits not handled yet
        self.actions = []

    def emit(self, action):
        self.actions.append(action)
        self.job = evolve(self.job, action)
        if isinstance(action, Stop):
            self._mark_stopped(action.worker_id)
        elif isinstance(action, HostFailed):
            if not self._own_hosts:
                self.hosts, self._own_hosts = self.hosts.copy(), True
            self.hosts.blacklist(action.host, self.now)
        elif isinstance(action, Spawn):
            self.workers[action.worker_id] = WorkerView(
                action.worker_id, action.host, action.slot, started=self.now,
                heartbeat_at=self.now)
        elif isinstance(action, (Fail, Finish, Stopped)):
            raise _Done()

    def _mark_stopped(self, wid):
        if wid in self.workers:
            self.workers[wid] = dataclasses.replace(self.workers[wid], stopped=True)
        elif wid in self.pending:
            self.pending[wid] = dataclasses.replace(self.pending[wid], stopped=True)

    def run(self):
        if self.facts.stop_signal is not None or self.job.stop_signal is not None:
            self.stopping()
            return
        if self.facts.liveness_checked:
            holders.note_commits(self)
            stragglers.check(self)
        self.handle_exits()
        self.check_end()
        self.check_liveness()
        self.check_stalls()
        verdicts.check_failure_reports(self)
        verdicts.abort_failed_replaced(self)
        self.check_preempted()
        self.reconcile()

    # -- graceful stop (SIGTERM/SIGINT to elasticrun) ---------------------------------------
    def stopping(self):
        """Every worker stops at the same commit (its collective check reads the stop
        key), rank 0 writing the final checkpoint; the rest are killed after --stop-timeout."""
        job = self.job
        if job.stop_signal is None:
            self.emit(BeginStop(self.facts.stop_signal, self.now))
            current = job.rounds.get(job.round_id, ())
            for wid, w in list(self.workers.items()):
                if wid not in current and not w.stopped:
                    self.emit(Stop(wid))        # newcomers and leavers have nothing to save
        for wid in list(self.pending):
            e = self.pending.pop(wid)
            if e.code != 0 and not e.stopped:
                # Peers blocked on it must give up their collective to reach the stop.
                for round_id, ids in list(self.job.rounds.items()):
                    if wid in ids and round_id not in self.job.aborted:
                        self.emit(Abort(round_id))
        code = 128 + self.job.stop_signal
        if not self.workers:
            self.emit(Stopped(code))
        if self.now - self.job.stop_at > self.limits.stop_timeout:
            late = tuple(sorted(self.workers))
            for wid in late:
                self.emit(Stop(wid))
            self.emit(Stopped(code, late))

    # -- preemption: SIGTERM to one worker -------------------------------------------------
    def check_preempted(self):
        if not self.job.preempted:
            return
        listed = self.hosts.discovered()
        for host, since in list(self.job.preempted.items()):
            # Gone from discovery (the machine went away): listed again, it is a fresh
            # host. Still listed after the hold: it was not going anywhere.
            if host not in listed or self.now - since > self.limits.preempted_hold:
                self.emit(Unpreempt(host))

    def preempt(self, wid, w, leaving):
        self.emit(Preempted(wid, w.host, int(leaving.get("signal") or 15), self.now))
        self.workers[wid] = dataclasses.replace(self.workers[wid], leaving_since=self.now)
        if not self.job.admitted(wid):
            self.emit(Stop(wid))            # never admitted: nothing to drain
        elif wid in self.job.member_set:
            self.emit(Reform())

    # -- stalls: a rank its peers wait on makes no progress -----------------------------------
    def check_stalls(self):
        if not self.facts.liveness_checked:
            return
        job = self.job
        watched = [(wid, w) for wid, w in self.workers.items()
                   if not w.stopped and w.ready and w.liveness is not None]
        if not long_waits((w.liveness for _, w in watched), self.limits.stall_timeout, self.now):
            return                        # nobody waited long enough for any stall rule
        live = [(r, ids) for r, ids in job.rounds.items() if r not in job.aborted]
        views = [StallView(wid, w.liveness, {r for r, ids in live if wid in ids})
                 for wid, w in watched]
        for stall in find_stalls(views, self.limits.stall_timeout, self.now):
            w = self.workers.get(stall.worker_id)
            if w is None or w.stopped:
                continue
            if stall.action == "warn":
                self.emit(StallWarning(stall.worker_id, describe(stall, w.host)))
            elif stall.action == "abort" and stall.round_id not in self.job.aborted:
                self.emit(Notice(f"worker {stall.worker_id} on {w.host} still waits in round "
                                 f"{stall.round_id}, which newer rounds replaced; aborting it",
                                 "round_aborted", (("round", stall.round_id),)))
                self.emit(Reform())
                self.emit(Abort(stall.round_id))
            elif stall.action == "evict":
                why = (f"{describe(stall, w.host)} (--stall-timeout "
                       f"{self.limits.stall_timeout:g} s)")
                self.emit(Stop(stall.worker_id))
                self.emit(Evict(stall.worker_id, w.host))
                self.host_failed(stall.worker_id, w.host, f"{why}; evicted")
                verdicts.rank_failed(self, "stall", stall.worker_id, w.host, why)

    # -- exits ----------------------------------------------------------------------------
    def handle_exits(self):
        if not self.pending:
            return
        current = self.job.member_set
        for wid in list(self.pending):
            e = self.pending.pop(wid)
            job = self.job
            if e.fatal and not e.stopped:
                self.emit(Fail(e.fatal))        # the job's error, not its host's: no blame
            kind = classify_exit(e.code, stopped_by_driver=e.stopped, in_current_round=wid in current,
                                 reported_done=e.done_round is not None,
                                 never_joined=not e.ready and job.round_id == 0)
            if e.leaving is not None and e.code == 0 and not e.stopped \
                    and job.final_round is None:
                if e.host not in job.preempted:
                    self.emit(Preempted(wid, e.host, int(e.leaving.get("signal") or 15),
                                        self.now))
                self.emit(Left(wid, e.host, e.leaving.get("commit")))
                if wid in current:
                    self.emit(Reform())
            elif job.final_round is not None and wid in job.rounds.get(job.final_round, ()):
                self.emit(RecordExit(wid, e.code, final=True))
            elif kind is ExitKind.FINISHED and job.round_id == 0:
                # A script that never called elastic.init(): the job is its processes.
                self.emit(StartFinishing(0, members=tuple(self.live_ids()) + (wid,)))
                self.stop_all_but_finals()
                self.emit(RecordExit(wid, e.code, final=True))
            elif kind is ExitKind.FINISHED:
                # A round the bookkeeping no longer keeps (or never had): the current one.
                done = e.done_round if e.done_round in job.rounds else job.round_id
                self.emit(StartFinishing(done))
                self.stop_all_but_finals()
                self.emit(RecordExit(wid, e.code, final=True))
            elif kind is ExitKind.FAILED:
                why = f"worker {wid} on {e.host} exited with code {e.code}{e.note}"
                self.emit(RecordExit(wid, e.code, final=False))
                self.host_failed(wid, e.host, why)
                if e.code > 0 and wid in current:       # an exception, not a signal
                    verdicts.rank_failed(self, "exception", wid, e.host, why)
            elif kind is ExitKind.REMOVED:
                self.emit(Removed(wid, e.host))

    def live_ids(self):
        """Live workers plus exits not handled yet: the driver's worker table at this point."""
        return list(self.workers) + list(self.pending)

    def stop_all_but_finals(self):
        finals = self.job.rounds.get(self.job.final_round, ())
        for wid in self.live_ids():
            if wid not in finals:
                self.emit(Stop(wid))

    def host_failed(self, wid, host, reason):
        """A failure blacklists the host and stops its other workers."""
        self.emit(HostFailed(wid, host, reason))
        dead = {wid}
        on_host = [w for w, v in self.workers.items() if v.host == host]
        on_host += [w for w, e in self.pending.items() if e.host == host]
        for other in on_host:
            self.emit(Stop(other))
            dead.add(other)
        for round_id, ids in list(self.job.rounds.items()):
            if round_id not in self.job.aborted and any(w in ids for w in dead):
                self.emit(Abort(round_id))
        if any(w in self.job.member_set for w in dead):
            self.emit(Reform())

    # -- the end --------------------------------------------------------------------------
    def check_end(self):
        job = self.job
        if job.final_round is None:
            kept = list(job.rounds.values())
            if job.round_id and not any(any(w in ids for ids in kept) for w in self.workers):
                self.emit(Fail(f"all workers failed (round {job.round_id} has no survivor "
                               "holding the training state)"))
            return
        finals = job.rounds[job.final_round]
        if any(wid in self.workers for wid in finals):
            return
        ok, failed = final_outcome(job.final_codes)
        if not ok:
            wid, code = sorted(failed.items())[0]
            self.emit(Fail(f"worker {wid} exited with code {code} at the end of training"))
        self.emit(Finish(job.final_round, len(finals)))

    # -- liveness -------------------------------------------------------------------------
    def check_liveness(self):
        if not self.facts.liveness_checked:
            return
        limits = self.limits
        hold = blackout.hold_silence(self.job, self.workers, self.now, limits.worker_timeout,
                                     self.emit)
        for wid in list(self.workers):
            w = self.workers[wid]
            if w.stopped:
                continue
            if w.leaving is not None and w.leaving_since is None:
                self.preempt(wid, w, w.leaving)
                w = self.workers[wid]
            if w.leaving_since is not None and self.now - w.leaving_since > limits.stop_timeout:
                why = (f"did not reach a commit within --stop-timeout {limits.stop_timeout:g} s "
                       "after SIGTERM")
            elif (not w.beats and not w.ready and self.job.round_id
                    and self.now - w.started > limits.startup_timeout):
                why = f"did not start within {limits.startup_timeout:.0f} s"
            elif (w.beats or w.ready) and not hold and \
                    blackout.silent_for(w, self.job, self.now) > limits.worker_timeout:
                # Ready counts as a beat: a worker whose every beat was lost or overwritten
                # before the driver read one would otherwise only be caught as a stall.
                why = f"sent no heartbeat for {limits.worker_timeout:.0f} s"
            else:
                continue
            self.emit(Stop(wid))
            self.emit(Evict(wid, w.host))
            self.host_failed(wid, w.host, f"worker {wid} on {w.host} {why}; evicted")

    # -- membership -----------------------------------------------------------------------
    def wanted_hosts(self):
        """host -> the slots wanted there: available, neither preempted nor drained."""
        available, out = self.hosts.available(self.now), self.job.preempted
        if self.facts.drained:
            out = {**out, **dict.fromkeys(self.facts.drained)}
        return {h: n for h, n in available.items() if h not in out} if out else available

    def reconcile(self):
        job, limits = self.job, self.limits
        if job.phase is Phase.FINISHING:
            return
        slots = self.wanted_hosts()
        n_wanted = sum(slots.values())
        unwanted, ready = [], 0       # ready: live workers on wanted slots, ready to train
        for wid, w in self.workers.items():
            if w.stopped:
                continue
            if 0 <= w.slot < slots.get(w.host, 0):
                ready += w.ready
            elif not job.admitted(wid):
                unwanted.append(wid)  # past rounds' workers leave by themselves at a commit
        for wid in unwanted:
            self.emit(Stop(wid))
        if job.phase is Phase.STARTING and n_wanted < limits.np and not self.workers:
            self.check_short(n_wanted, limits.np, "to start")
            return
        unchanged = job.phase is Phase.RUNNING and self.ready_are_members(slots, ready)
        m = len(job.members)
        if not (unchanged and (m >= n_wanted or m >= (limits.max_np or n_wanted))):
            self.spawn_missing(slots, n_wanted)   # (the members fill every slot it could use)
        job = self.job
        if unchanged:
            return                  # the plan would be the current round again
        # WorkerViews plan as Candidates do (worker_id, host, slot), without a copy each;
        # a worker a newer round left out is leaving, and is not planned again.
        candidates = [w for w in self.workers.values() if w.ready and not w.stopped
                      and 0 <= w.slot < slots.get(w.host, 0) and not job.left_out(w.worker_id)]
        target = plan_round(candidates, list(job.host_order), limits.max_np)
        if job.phase is Phase.STARTING:
            if n_wanted < limits.min_np:
                self.check_short(n_wanted, limits.min_np, "to start")
            elif self.any_starting(limits.startup_timeout):
                # Slots exist; workers are importing torch, which is not a shortage. The
                # start waits for all of them (nobody trains yet), up to --start-timeout.
                return
            elif len(target) < limits.min_np:
                self.check_short(len(target), limits.min_np, "to start")
            else:
                self.publish(target)
            return
        reforming = job.phase is Phase.REFORMING
        if not reforming and same_membership(job.members, target):
            return
        if len(target) < limits.min_np:
            if reforming:
                self.check_short(len(target), limits.min_np, "to continue")
            return
        if job.short_since is not None:
            self.emit(MarkShort(None))
        removals = job.member_set - {m.worker_id for m in target}
        if not reforming and not removals and self.any_starting(
                spawned_by=self.first_newcomer_start(target) + JOIN_TOGETHER_S):
            return   # batch newcomers spawned together that are still starting up
        if holders.may_form(self, target):
            self.publish(target)

    def any_starting(self, waited_at_most=JOIN_BATCH_S, spawned_by=float("inf")):
        """A newcomer is still importing torch (and has not been waited for too long);
        only one started by ``spawned_by`` counts."""
        now = self.now
        return any(not w.ready and not w.stopped and now - w.started < waited_at_most
                   and w.started <= spawned_by for w in self.workers.values())

    def first_newcomer_start(self, target):
        """When the earliest-started ready newcomer in ``target`` was spawned."""
        members = self.job.member_set
        return min((self.workers[m.worker_id].started for m in target
                    if m.worker_id not in members and m.worker_id in self.workers),
                   default=self.now)

    def ready_are_members(self, slots, ready):
        """True when the ``ready`` workers on wanted slots are exactly the current round's
        members, already in plan order (host_order, then slot) and within --max-np: then
        plan_round would return the current round. O(n), without planning."""
        job, workers, max_np = self.job, self.workers, self.limits.max_np
        if max_np is not None and len(job.members) > max_np:
            return False
        place, last = job.host_rank, (-1, -1)
        for m in job.members:
            w = workers.get(m.worker_id)
            if w is None or not w.ready or w.stopped or not 0 <= w.slot < slots.get(w.host, 0):
                return False
            key = (place.get(w.host), w.slot)
            if key[0] is None or key <= last:
                return False
            last = key
        return ready == len(job.members)

    def check_short(self, have, need, what):
        if self.job.short_since is None:
            self.emit(MarkShort(self.now))
        limits = self.limits
        if self.now - self.job.short_since > limits.elastic_timeout:
            self.emit(Fail(f"only {have} of the {need} slots needed {what} became available "
                           f"within --elastic-timeout {limits.elastic_timeout:g} s"))
        if self.hosts.all_blacklisted(self.now) and self.hosts.next_return_time(self.now) is None:
            last = self.job.last_failure
            self.emit(Fail("every host is blacklisted; no slots left to run on"
                           + (f" (last failure: {last})" if last else "")))

    def spawn_missing(self, slots, n_wanted):
        occupied = {(w.host, w.slot) for w in self.workers.values() if not w.stopped}
        room = (self.limits.max_np or n_wanted) - len(occupied)
        if room <= 0:
            return
        fresh = [(h, s) for h, n in slots.items() for s in range(n) if (h, s) not in occupied]
        fresh = fresh[:room]
        if not fresh:
            return
        ids = [str(self.job.next_worker + i) for i in range(len(fresh))]
        members = [m for m in self.job.members if m.worker_id in self.workers]
        tentative = plan_round(
            [_Seat(m.worker_id, m.host, self.workers[m.worker_id].slot)
             for m in members] + [_Seat(i, h, s) for i, (h, s) in zip(ids, fresh)],
            list(self.job.host_order))
        by_id = {m.worker_id: m for m in tentative}
        for wid, (host, slot) in zip(ids, fresh):
            self.emit(Spawn(wid, host, slot, by_id[wid]))

    def publish(self, members):
        job, limit = self.job, self.limits.reset_limit
        if job.round_id and limit is not None and job.resets + 1 > limit:
            self.emit(Fail(f"reset limit {limit} reached; membership changed too often"))
        change = describe_change(job.members, members) if job.members else "start"
        if job.round_id and job.round_id not in job.aborted and self.facts.joined < len(job.members):
            self.emit(Abort(job.round_id))  # replaced before it assembled: its members move on
        self.emit(Publish(job.round_id + 1, tuple(members), change))
