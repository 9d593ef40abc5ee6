"""The driver's event loop: discovery in, rounds out.

One thread makes every decision, on a short tick. Discovery runs in its own
thread and hands results over a queue, so a slow script never stalls the
loop. The decisions themselves live in pure functions (planner, exits,
hosts); this module only gathers facts and carries the decisions out.
"""

import logging
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field

from elastic import protocol as control
from elastic.protocol import ControlStore, Keys
from elastic.runner import launcher
from elastic.runner.discovery import BackgroundDiscovery, DiscoveryError
from elastic.runner.events import EventLog, RoundReporter
from elastic.runner.exits import ExitKind, classify_exit
from elastic.runner.hosts import HostManager
from elastic.runner.planner import Candidate, describe_change, plan_round, same_membership

log = logging.getLogger("elasticrun")
TICK_S = 0.05
HEARTBEAT_CHECK_S = 0.5
JOIN_BATCH_S = 15.0       # newcomers still importing torch are awaited this long
FAILURE_REPORT_GRACE_S = 1.0


class JobFailed(Exception):
    """The job cannot go on; str() is the one line the user sees."""


class Interrupted(Exception):
    def __init__(self, signum):
        super().__init__(signum)
        self.exit_code = 128 + signum


@dataclass
class JobConfig:
    command: list
    discovery: object
    np: int = 1
    min_np: int = 1
    max_np: int = None
    discovery_interval: float = 1.0
    elastic_timeout: float = 600.0
    reset_limit: int = None
    cooldown_range: tuple = None
    output_dir: str = None
    event_log: str = None
    worker_timeout: float = 30.0
    heartbeat_interval: float = 1.0
    extra_env: dict = field(default_factory=dict)
    ssh_port: int = None              # hosts that are not local are reached with ssh
    ssh_identity_file: str = None
    ssh_options: list = field(default_factory=list)   # "Key=Value" for ssh -o
    remote_python: str = "python3"    # runs elastic/runner/remote.py on remote hosts
    network_interface: str = None     # store address for remote workers; gloo/NCCL iface
    port: int = 0                     # the store's port (0: any free one)
    secret: str = None                # the job secret (None: a fresh one for this job)
    backend: object = None            # launches on the hosts it owns (joining agents)


@dataclass
class WorkerRecord:
    worker_id: str
    host: str
    slot: int
    proc: object
    started: float
    ready: bool = False
    stopped: bool = False
    heartbeat: int = 0
    heartbeat_at: float = 0.0


class Driver:
    def __init__(self, config):
        self.cfg = config
        self.hosts = HostManager(config.cooldown_range)
        self.secret = config.secret or secrets.token_hex(32)
        self.sink = launcher.OutputSink(config.output_dir)
        self.workers = {}          # live workers by id
        self.members = []          # current round's member dicts
        self.rounds = {}           # round id -> member ids
        self.aborted = set()
        self.round_id = 0
        self.resets = 0
        self.host_order = []
        self.next_worker = 0
        self.need_round_since = None
        self.failure_report_at = None
        self.final_round = None
        self.final_codes = {}
        self.failed_exits = {}     # worker id -> non-zero exit code
        self.started = time.monotonic()
        self.short_since = None
        self._last_heartbeat_check = 0.0
        self._discovery_error = None
        self._last_failure = None
        self._local_names = launcher.local_names()
        self.events = EventLog(config.event_log)

    # -- entry point ----------------------------------------------------------------
    def run(self):
        try:
            store = control.connect("0.0.0.0", self.cfg.port, 30, is_master=True)
        except RuntimeError as exc:
            raise JobFailed(f"cannot listen on port {self.cfg.port}: "
                            f"{' '.join(str(exc).split())[:200]}") from None
        self.store_port = store.port
        self.control = ControlStore(store, self.secret)
        self.reporter = RoundReporter(self.events, self.control)
        if self.cfg.backend is not None:
            self.cfg.backend.attach(self.store_port, self.secret, self.sink)
            log.info("serving on port %d: waiting for agents (elasticrun --join)",
                     self.store_port)
        self._first_discovery()
        background = BackgroundDiscovery(self.cfg.discovery, self.cfg.discovery_interval)
        background.start()
        try:
            while True:
                now = time.monotonic()
                self._take_discovery(background.poll(), now)
                self._reap(now)
                outcome = self._finish_if_done()
                if outcome is not None:
                    return outcome
                self._check_ready()
                self._check_heartbeats(now)
                self._check_failure_reports(now)
                self._reconcile(now)
                self.reporter.poll(now)
                time.sleep(TICK_S)
        finally:
            background.stop(timeout=1.0)
            self.reporter.flush()
            self._stop_all()
            if self.cfg.backend is not None:
                self.cfg.backend.close(0 if self.final_round is not None else 1)

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

    # -- worker exits -----------------------------------------------------------------
    def _reap(self, now):
        current = {m["worker_id"] for m in self.members}
        for wid, w in list(self.workers.items()):
            code = w.proc.poll()
            if code is None:
                continue
            del self.workers[wid]
            w.proc.join_output()
            done = self.control.get(Keys.done(wid))
            kind = classify_exit(code, stopped_by_driver=w.stopped, in_current_round=wid in current,
                                 reported_done=done is not None,
                                 ever_member=any(wid in ids for ids in self.rounds.values()),
                                 never_joined=not w.ready and self.round_id == 0)
            if self.final_round is not None and wid in self.rounds.get(self.final_round, ()):
                self.final_codes[wid] = code
                continue
            if kind is ExitKind.FINISHED and self.round_id == 0:
                # A script that never called elastic.init(): the job is its processes.
                self.rounds[0] = list(self.workers) + [wid]
                self._start_finishing(0)
                self.final_codes[wid] = code
            elif kind is ExitKind.FINISHED:
                self._start_finishing(done["round"] if done else self.round_id)
                self.final_codes[wid] = code
            elif kind is ExitKind.FAILED:
                self.failed_exits[wid] = code
                self._host_failed(w, f"worker {wid} on {w.host} exited with code {code}"
                                     f"{w.proc.describe_exit(code)}", now)
            elif kind is ExitKind.REMOVED:
                log.debug("worker %s left (removed from the job)", wid)
                self.events.emit("worker_removed", worker=wid, host=w.host)

    def _start_finishing(self, round_id):
        self.final_round = round_id
        log.info("training finished in round %d; waiting for its workers to exit", round_id)
        finals = set(self.rounds.get(round_id, ()))
        for wid in finals & self.failed_exits.keys():
            self.final_codes[wid] = self.failed_exits[wid]   # failed before the others finished
        for wid, w in self.workers.items():
            if wid not in finals:
                self._stop(w)

    def _finish_if_done(self):
        if self.final_round is None:
            if self.round_id and not any(
                    wid in ids for ids in self.rounds.values() for wid in self.workers):
                raise JobFailed(f"all workers failed (round {self.round_id} has no survivor "
                                "holding the training state)")
            return None
        finals = self.rounds[self.final_round]
        if any(wid in self.workers for wid in finals):
            return None
        failed = {wid: c for wid, c in self.final_codes.items() if c != 0}
        if failed:
            wid, code = sorted(failed.items())[0]
            raise JobFailed(f"worker {wid} exited with code {code} at the end of training")
        log.info("job finished: %d workers exited 0", len(finals))
        self.events.emit("job_finished", round=self.final_round, size=len(finals))
        return 0

    def _host_failed(self, w, why, now):
        """A failure blacklists the host and stops its other workers."""
        log.warning("%s; blacklisting host %s", why, w.host)
        self._last_failure = why
        self.events.emit("worker_failed", worker=w.worker_id, host=w.host, reason=why)
        self.events.emit("host_blacklisted", host=w.host)
        self.hosts.blacklist(w.host, now)
        dead = {w.worker_id}
        for other in list(self.workers.values()):
            if other.host == w.host:
                self._stop(other)
                dead.add(other.worker_id)
        for round_id, ids in self.rounds.items():
            if round_id not in self.aborted and dead & set(ids):
                self._abort(round_id)
        if dead & {m["worker_id"] for m in self.members}:
            self.need_round_since = self.need_round_since or now

    def _abort(self, round_id):
        self.aborted.add(round_id)
        self.control.put(Keys.abort(round_id), {"round": round_id})

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

    # -- liveness ---------------------------------------------------------------------
    def _check_ready(self):
        for w in self.workers.values():
            if not w.ready and self.control.has(Keys.ready(w.worker_id)):
                w.ready = True
                log.debug("worker %s on %s is ready", w.worker_id, w.host)
                self.events.emit("worker_ready", worker=w.worker_id, host=w.host)

    def _check_heartbeats(self, now):
        if now - self._last_heartbeat_check < HEARTBEAT_CHECK_S:
            return
        self._last_heartbeat_check = now
        for w in list(self.workers.values()):
            if w.stopped:
                continue
            beat = self.control.counter(Keys.heartbeat(w.worker_id))
            if beat != w.heartbeat:
                w.heartbeat, w.heartbeat_at = beat, now
            elif (not beat and not w.ready and self.round_id
                  and now - w.started > self._startup_timeout()):
                self._stop(w)
                self.events.emit("worker_evicted", worker=w.worker_id, host=w.host)
                self._host_failed(w, f"worker {w.worker_id} on {w.host} did not start within "
                                     f"{self._startup_timeout():.0f} s; evicted", now)
            elif beat and now - w.heartbeat_at > self.cfg.worker_timeout:
                self._stop(w)
                self.events.emit("worker_evicted", worker=w.worker_id, host=w.host)
                self._host_failed(w, f"worker {w.worker_id} on {w.host} sent no heartbeat for "
                                     f"{self.cfg.worker_timeout:.0f} s; evicted", now)

    def _startup_timeout(self):
        """A process that never reaches elastic.init() (a hung import) is evicted too."""
        return max(120.0, 4 * self.cfg.worker_timeout)

    def _check_failure_reports(self, now):
        """A worker saw a collective fail but no process died (yet): re-form the round."""
        r = self.round_id
        if not r or r in self.aborted or self.final_round is not None:
            self.failure_report_at = None
            return
        if self.control.counter(Keys.failures(r)) == 0:
            return
        self.failure_report_at = self.failure_report_at or now
        if now - self.failure_report_at >= FAILURE_REPORT_GRACE_S:
            log.warning("round %d reported a failed collective; re-forming it", r)
            self._abort(r)
            self.need_round_since = self.need_round_since or now
            self.failure_report_at = None

    # -- membership -----------------------------------------------------------------------
    def _wanted_slots(self, now):
        return [(h, s) for h, n in self.hosts.available(now).items() for s in range(n)]

    def _reconcile(self, now):
        if self.final_round is not None:
            return
        wanted = self._wanted_slots(now)
        wanted_set = set(wanted)
        admitted = {wid for ids in self.rounds.values() for wid in ids}
        for w in list(self.workers.values()):
            # Workers of a past round leave by themselves at their next commit.
            if (w.host, w.slot) not in wanted_set and w.worker_id not in admitted \
                    and not w.stopped:
                self._stop(w)
        if self.round_id == 0 and len(wanted) < self.cfg.np and not self.workers:
            self._check_short(len(wanted), self.cfg.np, now, "to start")
            return
        self._spawn_missing(wanted, now)
        candidates = [Candidate(w.worker_id, w.host, w.slot) for w in self.workers.values()
                      if w.ready and not w.stopped and (w.host, w.slot) in wanted_set]
        target = plan_round(candidates, self.host_order, self.cfg.max_np)
        starting = [w for w in self.workers.values() if not w.ready and not w.stopped
                    and now - w.started < JOIN_BATCH_S]
        if self.round_id == 0:
            if len(wanted) < self.cfg.min_np:
                self._check_short(len(wanted), self.cfg.min_np, now, "to start")
            elif starting:
                return   # slots exist; workers are importing torch, which is not a shortage
            elif len(target) < self.cfg.min_np:
                self._check_short(len(target), self.cfg.min_np, now, "to start")
            else:
                self._publish(target, now)
            return
        if self.need_round_since is None and same_membership(self.members, target):
            return
        if len(target) < self.cfg.min_np:
            if self.need_round_since is not None:
                self._check_short(len(target), self.cfg.min_np, now, "to continue")
            return
        self.short_since = None
        current = {m["worker_id"] for m in self.members}
        removals = current - {m["worker_id"] for m in target}
        if self.need_round_since is None and not removals and starting:
            return   # batch newcomers that are still starting up
        self._publish(target, now)

    def _check_short(self, have, need, now, what):
        self.short_since = self.short_since or now
        if now - self.short_since > self.cfg.elastic_timeout:
            raise JobFailed(f"only {have} of the {need} slots needed {what} became available "
                            f"within --elastic-timeout {self.cfg.elastic_timeout:g} s")
        if self.hosts.all_blacklisted(now) and self.hosts.next_return_time(now) is None:
            last = f" (last failure: {self._last_failure})" if self._last_failure else ""
            raise JobFailed(f"every host is blacklisted; no slots left to run on{last}")

    def _spawn_missing(self, wanted, now):
        occupied = {(w.host, w.slot) for w in self.workers.values() if not w.stopped}
        room = (self.cfg.max_np or len(wanted)) - len(occupied)
        fresh = [hs for hs in wanted if hs not in occupied][:max(room, 0)]
        if not fresh:
            return
        ids = [str(self.next_worker + i) for i in range(len(fresh))]
        self.next_worker += len(fresh)
        members = [m for m in self.members if m["worker_id"] in self.workers]
        tentative = plan_round(
            [Candidate(m["worker_id"], m["host"], self.workers[m["worker_id"]].slot)
             for m in members] + [Candidate(i, h, s) for i, (h, s) in zip(ids, fresh)],
            self.host_order)
        by_id = {m["worker_id"]: m for m in tentative}
        for wid, (host, slot) in zip(ids, fresh):
            proc = self._launch(wid, host, by_id[wid])
            self.workers[wid] = WorkerRecord(wid, host, slot, proc, now, heartbeat_at=now)

    def _launch(self, wid, host, assignment):
        env = dict(self.cfg.extra_env)     # what the job sets; our own environment is added below
        env.update({
            control.ENV_ADDR: "127.0.0.1", control.ENV_PORT: str(self.store_port),
            control.ENV_SECRET: self.secret, control.ENV_WORKER_ID: wid,
            "PYTHONUNBUFFERED": "1",
            control.ENV_ROUND_TIMEOUT: str(self.cfg.elastic_timeout + 120),
            control.ENV_HEARTBEAT_INTERVAL: str(self.cfg.heartbeat_interval),
        })
        env.update(control.membership_env(assignment, host))
        iface = self.cfg.network_interface
        if iface:
            env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = iface
        if self.cfg.backend is not None and self.cfg.backend.owns(host):
            # A joining agent runs it: only what the job sets travels, not our environment.
            return self.cfg.backend.start(wid, host, env)
        env = {**os.environ, **env}
        if launcher.is_local(host, self._local_names):
            env[control.ENV_DRIVER_PID] = str(os.getpid())
            try:
                return launcher.start_local(wid, host, self.cfg.command, env, self.sink)
            except OSError as exc:
                raise JobFailed(f"cannot start {self.cfg.command[0]!r}: {exc.strerror}") from None
        try:
            # None: the address this machine uses towards the host, found per host.
            store_addr = launcher.interface_ipv4(iface) if iface else None
        except OSError as exc:
            raise JobFailed(f"--network-interface {exc}") from None
        ssh = launcher.SshSettings(self.cfg.ssh_port, self.cfg.ssh_identity_file,
                                   list(self.cfg.ssh_options), self.cfg.remote_python)
        try:
            return launcher.start_ssh(wid, host, self.cfg.command, env, self.sink, ssh,
                                      store_addr=store_addr)
        except OSError as exc:
            raise JobFailed(f"cannot run ssh to reach host {host}: {exc.strerror}") from None

    def _publish(self, members, now):
        if self.round_id:
            self.resets += 1
            if self.cfg.reset_limit is not None and self.resets > self.cfg.reset_limit:
                raise JobFailed(f"reset limit {self.cfg.reset_limit} reached; "
                                "membership changed too often")
        previous = self.members
        self.round_id += 1
        r = self.round_id
        self.control.put(Keys.plan(r), {"round": r, "members": members})
        self.control.put(Keys.LATEST_ROUND, {"round": r})
        self.rounds[r] = [m["worker_id"] for m in members]
        self.members = members
        for m in members:
            if m["host"] not in self.host_order:
                self.host_order.append(m["host"])
        self.host_order = [h for h in self.host_order if any(m["host"] == h for m in members)]
        change = describe_change(previous, members) if previous else "start"
        self.reporter.round_started(r, members, change, now)
        self.need_round_since = None
        self.short_since = None


def install_signal_handlers():
    def handler(signum, _frame):
        raise Interrupted(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def run_job(config):
    """Run a job; returns the process exit code. Errors print one line."""
    install_signal_handlers()
    driver = Driver(config)
    try:
        return driver.run()
    except JobFailed as exc:
        driver.events.emit("job_failed", reason=str(exc))
        sys.stderr.write(f"elasticrun: error: {exc}\n")
        return 1
    except Interrupted as exc:
        sys.stderr.write(f"elasticrun: stopped by signal {exc.args[0]}; workers stopped\n")
        return exc.exit_code
