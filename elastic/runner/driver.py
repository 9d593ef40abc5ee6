"""The driver's event loop: discovery in, rounds out.

One thread runs the job, on a short tick: it gathers facts (exits, readiness,
heartbeats, failure reports, the hosts discovery found), hands them to the pure
``policy.decide`` and carries out the actions it returns (spawn, stop, publish a
round, abort one, blacklist a host, finish, fail). Discovery runs in its own
thread and hands results over a queue, so a slow script never stalls the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import sys
import time
from types import FrameType

from elastic import protocol as control
from elastic.exceptions import ElasticError
from elastic.protocol import Keys
from elastic.runner import console, launcher
from elastic.runner.adoption import Adoption
from elastic.runner.control_plane import DriverControl
from elastic.runner.decisions import (
    Abort,
    BeginStop,
    Evict,
    Exit,
    Facts,
    Fail,
    Finish,
    HostFailed,
    Job,
    Left,
    Notice,
    Phase,
    Preempted,
    Publish,
    Removed,
    Spawn,
    StallWarning,
    StartFinishing,
    Stop,
    Stopped,
    evolve,
)
from elastic.runner.discovery import BackgroundDiscovery, DiscoveryError
from elastic.runner.events import EventLog, RoundReporter
from elastic.runner.hosts import HostManager
from elastic.runner.job_config import JobConfig
from elastic.runner.outage import CHECKPOINT, FINISHED, GO, LOST, WAIT, decide_outage
from elastic.runner.policy import can_skip, decide
from elastic.runner.records import Observed, WorkerRecord
from elastic.runner.spares import Spares
from elastic.runner.stalls import exit_poll_interval, heartbeat_interval, heartbeat_read_interval
from elastic.runner.state_dir import StateDir, resume
from elastic.runner.watch import Watch, WatchError

log = logging.getLogger("elasticrun")
TICK_S = 0.05
SPARES_EVERY_S = 0.5           # --warm-spare: how often the spares are looked after
ABORTS_KEPT = 3             # aborts of this many recent rounds are kept in place


class JobFailed(ElasticError):
    """The job cannot go on; str() is the one line the user sees."""


class Interrupted(ElasticError):
    """elasticrun got SIGINT or SIGTERM; its workers are stopped on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.exit_code = 128 + signum


class Driver:
    """Gathers facts, asks ``policy.decide`` and carries out its actions."""

    def __init__(self, config: JobConfig) -> None:
        self.cfg = config
        self.limits = config.limits()       # steering (elasticctl resize) replaces it
        self.hosts = HostManager(config.cooldown_range)
        self.secret, self.worker_secret = control.job_keys(config.secret or secrets.token_hex(32))
        self.sink = config.console or console.Console(config.output_dir)
        self.job = Job()
        self.workers: dict[str, WorkerRecord] = {}   # live workers by id
        self.started = time.monotonic()
        self._last_heartbeat_check = 0.0
        self._last_exit_poll = 0.0
        self._discovery_error = None
        self._local_names = launcher.local_names()
        self.events = EventLog(config.event_log)
        self.stop_signal: int | None = None    # the first SIGTERM/SIGINT to elasticrun
        self._published_at = 0.0
        self._settled_at: float | None = None    # when decide last ran and returned nothing (quiet ticks)
        self._decided_version = -1
        self._newly_ready = 0
        self._last_spawn_at: float | None = None
        self.quiet_ticks = 0
        self._unready: set[str] = set()   # live workers whose registration has not been seen
        self.adoption = Adoption(wait_s=config.worker_timeout)   # a restarted --serve adopts live workers
        self.saved = StateDir(config.state_dir)    # ... and takes back what it kept there
        self.job = resume(self.saved, self.job, self.hosts, self.adoption, self.started)
        self.outage = None         # a serving driver's verdict on its predecessor's absence
        self._away_exits: list[Exit] = []   # workers that failed while no driver read their exit
        self.spares = Spares(config.command) if config.warm_spare else None
        self._spares_at = 0.0

    def request_stop(self, signum: int) -> None:
        """First SIGTERM/SIGINT: stop at the next commit; a second one: stop at once."""
        if self.stop_signal is not None:
            raise Interrupted(signum)
        self.stop_signal = signum

    @property
    def phase(self) -> Phase:
        return self.job.phase

    # -- entry point ----------------------------------------------------------------
    def run(self) -> int:
        backend = self.cfg.backend
        serving = backend is not None               # agents join from other hosts
        if not serving:
            self._first_discovery()                 # the hosts decide where to listen
        try:
            self.plane = DriverControl(self.hosts.discovered(), self._local_names, self.worker_secret,
                                       self.cfg.network_interface, serving, self.cfg.port)
        except (OSError, RuntimeError) as exc:
            raise JobFailed(f"cannot listen on port {self.cfg.port}: "
                            f"{' '.join(str(exc).split())[:200]}") from None
        self.store_port, self.control = self.plane.port, self.plane.store
        self.reporter = RoundReporter(self.events, self.control, self.cfg.start_warning)
        self.watch = Watch(self)                    # status, steering, metrics (elasticctl)
        if backend is not None:
            backend.attach(self.plane.binding.local_connect_address(), self.store_port,
                                    self.secret, self.sink)
            log.info("serving on port %d: waiting for agents (elasticrun --join)",
                     self.store_port)
            self._serving_at = time.monotonic()
            self._first_discovery()
        background = BackgroundDiscovery(self.cfg.discovery, self.cfg.discovery_interval)
        background.start()
        try:
            while True:
                now = time.monotonic()
                self._take_discovery(background.poll(), now)
                if serving:
                    self._adopt(now)
                seen = self._observe(now)
                if serving and self.outage is None and \
                        (code := self._settle_outage(now, seen)) is not None:
                    return code
                if serving and self.outage is None:
                    self._away_exits[:0] = seen.exits      # nothing starts before the verdict
                elif self._quiet(seen, now):
                    self.quiet_ticks += 1           # nothing decide could act on: O(1)
                else:
                    self._decided_version, self._newly_ready = self.hosts.version, 0
                    actions = decide(self._facts(seen), now)
                    self._settled_at = None if actions else now
                    for action in actions:
                        outcome = self._carry_out(action, now)
                        self.saved.note(action, self.job, self.hosts, now)
                        if outcome is not None:
                            return outcome
                self.reporter.poll(now)
                if self.watch.tick(now):
                    self._settled_at = None          # steered: decide looks again
                self.plane.heal(now)
                if self.spares is not None:
                    self.spares.read()
                    self._refill_spares(now)
                self._sleep_tick()
        finally:
            background.stop(timeout=1.0)
            self.reporter.flush()
            self.watch.close()
            self._stop_all()
            if self.spares is not None:
                self.spares.close()      # after its workers: they die with it
            if self.cfg.backend is not None:
                self.cfg.backend.close(0 if self.job.final_round is not None else 1)
            self.plane.close()

    def _sleep_tick(self):
        """Wait out the tick, or less where a worker's output ended (it exited, most likely):
        its exit is polled at once, not up to a tick later."""
        ended = getattr(self.sink, "stream_ended", None)
        if ended is None or not ended.wait(TICK_S):
            return
        ended.clear()
        self._last_exit_poll = float("-inf")

    # -- discovery ------------------------------------------------------------------
    def _first_discovery(self):
        try:
            hosts = self.cfg.discovery.discover()
        except DiscoveryError as exc:
            raise JobFailed(f"host discovery failed: {exc}") from None
        self.hosts.update(hosts, time.monotonic())

    def _take_discovery(self, results, now):
        for result in results:
            if result.error is not None:
                if result.error != self._discovery_error:
                    log.warning("host discovery failed, keeping the last host set: %s",
                                result.error)
                self._discovery_error = result.error
                continue
            self._discovery_error = None
            changes = self.hosts.update(result.hosts, now)
            if changes:
                log.info("discovery: %s", ", ".join(
                    f"{k} {', '.join(v)}" for k, v in (("added", changes.added),
                                                       ("removed", changes.removed),
                                                       ("changed", changes.changed)) if v))
        for host in self.hosts.returning(now):
            log.info("host %s is back from the blacklist", host)
            self.events.emit("host_restored", host=host)

    # -- facts ----------------------------------------------------------------------
    def _quiet(self, seen, now):
        return can_skip(self.job, self.limits, now, settled_at=self._settled_at,
                        exits=seen.exits, liveness_checked=seen.liveness_checked,
                        failure_reports=bool(seen.failure_reports or seen.replaced_failed),
                        newly_ready=self._newly_ready,
                        unready=seen.unready, last_spawn_at=self._last_spawn_at,
                        hosts_changed=self.hosts.version != self._decided_version,
                        stop_signal=self.stop_signal)

    def _facts(self, seen):
        return Facts(job=self.job, limits=self.limits, hosts=self.hosts,
                     workers={wid: w.view() for wid, w in self.workers.items()},
                     exits=tuple(seen.exits), liveness_checked=seen.liveness_checked,
                     failure_reports=len(seen.failure_reports), joined=seen.joined,
                     failure_errors=seen.failure_reports, stop_signal=self.stop_signal,
                     replaced_failed=seen.replaced_failed,
                     drained=self.watch.drained)

    def _observe(self, now):
        """This tick's observations: exits (every stalls.exit_poll_interval), registrations,
        heartbeats (every stalls.heartbeat_read_interval), failure reports and the current
        round's assembly."""
        exits, ended, self._away_exits = self._away_exits, [], []
        if now - self._last_exit_poll >= exit_poll_interval(len(self.workers), TICK_S):
            self._last_exit_poll = now
            ended = [(wid, w, code) for wid, w in self.workers.items()
                     if (code := w.proc.poll()) is not None]
        for wid, w, code in ended:
            del self.workers[wid]
            self._unready.discard(wid)
            w.proc.join_output()
            done = self.control.get(Keys.done(wid))
            exits.append(Exit(wid, w.host, code, stopped=w.stopped, ready=w.ready,
                              done_round=done["round"] if done else None,
                              note=w.proc.describe_exit(code) if code else "",
                              leaving=self.control.get_object(Keys.leaving(wid)),
                              fatal=self._fatal_line(wid, code)))
            self.plane.worker_gone(wid)
        found = self.plane.ready(self._unready, now) if self._unready else ()
        ready, self.job = self.adoption.release(found, now, self.job, self.control,
                                                self.workers)
        for wid in ready:
            w = self.workers[wid]
            w.ready = True
            w.heartbeat_at = max(w.heartbeat_at, now)   # its sealed ready key: alive now
            self._unready.discard(wid)
            self._newly_ready += 1
            log.debug("worker %s on %s is ready", w.worker_id, w.host)
            self.events.emit("worker_ready", worker=w.worker_id, host=w.host)
        checked = now - self._last_heartbeat_check >= self._heartbeat_check_s()
        if checked:
            self._last_heartbeat_check = now
            live = [w for w in self.workers.values() if not w.stopped]
            beats = self.plane.heartbeat_values([w.worker_id for w in live])
            for w in live:
                value = beats[w.worker_id]     # forged or replayed beats read as None
                if value is not None and w.liveness.update(value, now):
                    w.heartbeat, w.heartbeat_at = w.liveness.beat, now
                if w.liveness.leaving and w.leaving is None:
                    w.leaving = self.control.get_object(Keys.leaving(w.worker_id)) or {"signal": 15}
        job = self.job
        reports = {}
        if job.round_id and job.round_id not in job.aborted and job.final_round is None:
            reports = self.plane.failure_reports(job.round_id, job.rounds.get(job.round_id, ()))
        joined = self._assembly(job, now) if job.round_id else 0
        waiting = sum(1 for wid in self._unready if not self.workers[wid].stopped)
        replaced = ()
        if job.round_id and joined < len(job.members):
            # Members still away may be stuck in a round this one replaced, on a peer that
            # failed there: its report names that round (verdicts.abort_failed_replaced).
            replaced = self.plane.rang(rid for rid in job.rounds if rid < job.round_id
                                       and rid not in job.aborted and rid != job.final_round)
        return Observed(exits, checked, reports, joined, waiting, replaced)

    def _settle_outage(self, now, seen):
        """Decide what the time the previous driver was away means (outage.py): returns
        the exit code when the job is over already. Adopted workers may still exit (they
        finished as the driver died): the verdict is final once they are in a round."""
        kept, back = self.saved.kept, self.cfg.backend.outage_report()
        waited = now - self._serving_at
        verdict = decide_outage(kept, back, waited, self.cfg.worker_timeout)
        if verdict.kind == WAIT or verdict.kind == GO and kept.round and back.live and \
                not self.adoption.settled() and waited < self.cfg.worker_timeout:
            return None
        self.outage = verdict
        if verdict.kind == FINISHED:
            log.info("%s", verdict.line)
            self.job = dataclasses.replace(self.job, final_round=kept.round)
            self.events.emit("job_finished", round=kept.round, size=len(kept.members),
                             driver_away=True)
            self.saved.note(Finish(kept.round, len(kept.members)), self.job, self.hosts, now)
            return 0
        if verdict.kind == LOST:
            raise JobFailed(verdict.line)
        if verdict.kind == CHECKPOINT:
            self.reporter.notice(verdict.line, "state_lost", {"commit": kept.commit,
                                                              "checkpoint": kept.durable})
        return None

    def _adopt(self, now):
        self._away_exits += [Exit(wid, host, code, ready=True, note=" while the driver was away")
                             for wid, host, code in self.cfg.backend.take_failed_away()]
        records, self.job = self.adoption.take(self.cfg.backend, self.workers, self.job, now,
                                               self.hosts.discovered())
        for record in records:
            self.workers[record.worker_id] = record
            self._unready.add(record.worker_id)
            self.events.emit("worker_adopted", worker=record.worker_id, host=record.host)

    def _refill_spares(self, now):
        """The warm spare (spares.py), started only while a round runs: never while the
        first round's workers start."""
        if self.job.phase is not Phase.RUNNING or self.stop_signal is not None \
                or now - self._spares_at < SPARES_EVERY_S:
            return
        self._spares_at = now
        if self.spares.refill():
            log.debug("a warm spare is starting")

    def _heartbeat_check_s(self):
        return heartbeat_read_interval(len(self.workers), self.cfg.worker_timeout)

    def _assembly(self, job, now):
        """Members of the current round that arrived (all of them once it assembled)."""
        count = self.plane.assembly(job.round_id, now)
        if count is None:
            return len(job.members)
        if count == len(job.members):
            seconds = now - self._published_at
            log.debug("round %d assembled in %.3f s", job.round_id, seconds)
            self.events.emit("round_assembled", round=job.round_id, size=count,
                             seconds=round(seconds, 4))
        return count

    def _fatal_line(self, wid, code):
        """What a worker that exited with EXIT_STOP_JOB said stops the job (worker/fatal.py)."""
        value = self.control.get_object(Keys.fatal(wid)) if code == control.EXIT_STOP_JOB else None
        line = str(value.get("line") or "")[:2000] if value else ""
        return line or None

    # -- actions ----------------------------------------------------------------------
    def _carry_out(self, action, now):
        """Do what ``action`` says; returns the job's exit code once it is over."""
        self.job = evolve(self.job, action)
        if isinstance(action, Spawn):
            self.plane.announce()      # where the workers connect, said once they start
            self._last_spawn_at = now
            proc = self._launch(action.worker_id, action.host, action.assignment)
            self.workers[action.worker_id] = WorkerRecord(
                action.worker_id, action.host, action.slot, proc, now, heartbeat_at=now)
            self._unready.add(action.worker_id)
        elif isinstance(action, Stop):
            w = self.workers.get(action.worker_id)
            if w is not None:
                self._stop(w)
        elif isinstance(action, Evict):
            self.events.emit("worker_evicted", worker=action.worker_id, host=action.host)
        elif isinstance(action, HostFailed):
            log.warning("%s; blacklisting host %s", action.reason, action.host)
            self.sink.worker_failed(action.worker_id, action.host, action.reason)
            self.events.emit("worker_failed", worker=action.worker_id, host=action.host,
                             reason=action.reason)
            self.events.emit("host_blacklisted", host=action.host)
            self.hosts.blacklist(action.host, now)
        elif isinstance(action, Abort):
            self.plane.abort(action.round_id)
        elif isinstance(action, Publish):
            self._publish(action, now)
        elif isinstance(action, Removed):
            log.debug("worker %s left (removed from the job)", action.worker_id)
            self.events.emit("worker_removed", worker=action.worker_id, host=action.host)
        elif isinstance(action, StartFinishing):
            log.info("training finished in round %d; waiting for its workers to exit",
                     action.round_id)
        elif isinstance(action, Preempted):
            w = self.workers.get(action.worker_id)
            if w is not None:
                w.leaving_since = now
            log.warning("worker %s on %s got signal %d: it leaves at its next commit; host %s "
                        "is preempted (not blacklisted)", action.worker_id, action.host,
                        action.signal, action.host)
            self.events.emit("host_preempted", host=action.host, worker=action.worker_id)
        elif isinstance(action, Left):
            log.info("worker %s on %s left at commit %s (preempted)", action.worker_id,
                     action.host, action.commit)
            self.events.emit("worker_removed", worker=action.worker_id, host=action.host,
                             reason="preempted")
        elif isinstance(action, Notice):
            self.reporter.notice(action.line, action.event, dict(action.fields))
        elif isinstance(action, StallWarning):
            w = self.workers.get(action.worker_id)
            if w is not None:
                w.liveness.warned = True
            log.warning("%s", action.line)
        elif isinstance(action, BeginStop):
            self.control.put(Keys.STOP, {"signal": action.signal}, keep=True)
            log.info("signal %d: stopping; every worker finishes its step and stops at the "
                     "next commit (at most --stop-timeout %g s)", action.signal,
                     self.cfg.stop_timeout)
        elif isinstance(action, Stopped):
            if action.killed:
                log.warning("stopped by signal %d: %d workers did not stop within "
                            "--stop-timeout %g s and were killed (%s)", self.stop_signal,
                            len(action.killed), self.cfg.stop_timeout, ", ".join(action.killed))
            else:
                log.info("stopped by signal %d: every worker stopped", self.stop_signal)
            self.events.emit("job_stopped", signal=self.stop_signal, round=self.job.round_id,
                             killed=list(action.killed))
            return action.code
        elif isinstance(action, Fail):
            raise JobFailed(action.reason)
        elif isinstance(action, Finish):
            log.info("job finished: %d workers exited 0", action.size)
            self.events.emit("job_finished", round=action.round_id, size=action.size)
            return 0
        return None

    def _stop(self, w):
        w.stopped = True
        w.proc.kill()

    def _stop_all(self):
        for w in self.workers.values():
            self._stop(w)
        deadline = time.monotonic() + 5
        for w in self.workers.values():
            while w.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)

    def _beat_interval(self):
        """The configured interval, slowed down for the job's size (stalls.heartbeat_interval)."""
        size = max(len(self.workers) + 1, self.cfg.np or 0)
        return heartbeat_interval(size, self.cfg.worker_timeout, self.cfg.heartbeat_interval)

    def _launch(self, wid, host, assignment):
        env = dict(self.cfg.extra_env)     # what the job sets; our own environment is added below
        env.update({
            control.ENV_ADDR: self.plane.binding.local_connect_address(),
            control.ENV_PORT: str(self.store_port),
            control.ENV_SECRET: self.worker_secret, control.ENV_WORKER_ID: wid,
            "PYTHONUNBUFFERED": "1",
            control.ENV_ROUND_TIMEOUT: str(max(self.cfg.elastic_timeout,
                                               self.cfg.stall_timeout) + 120),
            control.ENV_HEARTBEAT_INTERVAL: str(self._beat_interval()),
        })
        env.update(control.membership_env(assignment.to_json(), host))
        if control.ENV_COLLECTIVE_TIMEOUT not in os.environ:
            # The workers' own collective deadline is the backstop: the driver evicts first.
            env.setdefault(control.ENV_COLLECTIVE_TIMEOUT,
                           str(max(600, self.cfg.stall_timeout + 120)))
        iface = self.cfg.network_interface
        if iface:
            env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = iface
        if self.cfg.backend is not None and self.cfg.backend.owns(host):
            # A joining agent runs it: only what the job sets travels, not our environment.
            return self.cfg.backend.start(wid, host, env)
        env = {**os.environ, **env}
        if launcher.is_local(host, self._local_names):
            env[control.ENV_DRIVER_PID] = str(os.getpid())
            spare = self.spares.take(env) if self.spares is not None else None
            if self.spares is not None:
                self.spares.note_worker(env)
            if spare is not None:
                log.info("worker %s on %s: the warm spare forks it", wid, host)
                self.events.emit("warm_spare_used", worker=wid, host=host)
                return launcher.adopt_local(wid, host, spare, self.sink)
            try:
                return launcher.start_local(wid, host, self.cfg.command, env, self.sink)
            except OSError as exc:
                raise JobFailed(f"cannot start {self.cfg.command[0]!r}: {exc.strerror}") from None
        store_addr = self.plane.remote_address(host)     # None: per host
        ssh = launcher.SshSettings(self.cfg.ssh_port, self.cfg.ssh_identity_file,
                                   list(self.cfg.ssh_options), self.cfg.remote_python)
        try:
            return launcher.start_ssh(wid, host, self.cfg.command, env, self.sink, ssh,
                                      store_addr=store_addr)
        except OSError as exc:
            raise JobFailed(f"cannot run ssh to reach host {host}: {exc.strerror}") from None

    def _publish(self, action, now):
        r = action.round_id
        members = list(action.members)
        self.plane.publish(r, members)                  # kept values: put back if overwritten
        self.sink.set_ranks(members)
        self._published_at = now
        self.control.forget(Keys.abort(r - ABORTS_KEPT))
        self.reporter.round_started(r, members, action.change, now)


def install_signal_handlers(driver: Driver) -> None:
    def handler(signum: int, _frame: FrameType | None) -> None:
        driver.request_stop(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def run_job(config: JobConfig) -> int:
    """Run a job; returns the process exit code. Errors print one line."""
    driver = Driver(config)
    install_signal_handlers(driver)
    try:
        return driver.run()
    except (JobFailed, WatchError) as exc:
        driver.events.emit("job_failed", reason=str(exc))
        driver.sink.report()                            # the root cause, then the reason
        sys.stderr.write(f"elasticrun: error: {exc}\n")
        return 1
    except Interrupted as exc:
        sys.stderr.write(f"elasticrun: stopped by signal {exc.args[0]}; workers stopped\n")
        return exc.exit_code
