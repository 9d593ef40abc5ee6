"""``elasticrun --join HOST:PORT``: the agent that runs a node's or pod's workers.

The cluster (Kubernetes, Slurm, Ray) starts one agent per node; the agent
registers its host and slots with a serving driver (``elasticrun --serve``)
and becomes the driver's launcher on that host: it starts and kills local
workers when the driver's signed requests say so, reports their exits, and
forwards their output (also printed here, with the same ``[id]<stream>:``
prefix, for the pod's or node's own log).

Life and death: workers get PDEATHSIG and the agent's pid, so they die with
the agent. The driver acknowledges each heartbeat with a sealed ack; when the
acks stop (the driver is gone), the agent keeps its workers, which train on,
for ``driver_grace`` seconds (docs/failure-model.md). A driver that comes back
at the same address and proves the job secret gets the agent's registration
again, with the live workers it adopts (runner/adoption.py); if none does, the
agent stops its workers as a SIGTERM would (final checkpoint) and exits with
one line. SIGTERM (pod eviction, Slurm preemption) drains: the agent tells the
driver it is leaving, forwards SIGTERM to its workers, waits up to
``stop_timeout`` for them, and exits.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType

from elastic import protocol
from elastic.exceptions import ElasticError
from elastic.protocol import AgentKeys, ControlError, ControlStore
from elastic.runner import launcher, spawn_env
from elastic.runner.agent_outbox import (  # noqa: F401 - tests read the bounds here
    MAX_LINE_CHARS,
    MAX_QUEUED_LINES,
    MAX_REPORT_LINES,
    ForwardingSink,
    Outbox,
)
from elastic.runner.spares import Spares

log = logging.getLogger("elasticrun")
TICK_S = 0.1
SPARE_AFTER_S = 5.0     # --warm-spare: a spare starts once no worker started here this long
BEAT_S = 0.5
HELLO_WAIT_S = 3.0          # a wrong secret is told after this long at most
ACCEPT_WAIT_S = 30.0
FLUSH_WAIT_S = 5.0          # a drained agent waits this long for the driver to read its last reports
DRIVER_SILENT_S = 5.0       # no ack of our beats for this long: is the driver still there?
ANSWER_WAIT_S = 5.0         # a (restarted) driver answers a beat or a registration by then
DEFAULT_DRIVER_GRACE_S = 120.0


class AgentFailed(ElasticError):
    """The agent cannot go on; str() is the one line the user sees."""


@dataclass
class AgentConfig:
    driver_host: str
    driver_port: int
    secret_file: str
    command: list[str]
    host_name: str
    slots: int = 1
    connect_timeout: float = 60.0
    stop_timeout: float = 20.0
    output_dir: str | None = None
    quiet: bool = False               # True: forward output to the driver only
    driver_grace: float = DEFAULT_DRIVER_GRACE_S   # keep the workers this long without a driver
    warm_spare: bool = False          # a started python that becomes the next worker (spares.py)


def read_secret_file(path: str) -> bytes:
    """The job secret from ``path``; AgentFailed with one line when it is unusable."""
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise AgentFailed(f"--secret-file {path!r}: {exc.strerror}") from None
    if not secret:
        raise AgentFailed(f"--secret-file {path!r} is empty")
    return secret


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.secret = read_secret_file(cfg.secret_file)
        self.outbox = Outbox()
        self.sink = ForwardingSink(cfg.output_dir, self.outbox, cfg.quiet)
        self.workers: dict[str, launcher.WorkerProcess] = {}
        self.index: str | None = None
        self.beat_seq = 0
        self.received = 0
        self.sent = 0
        self.acked = 0             # reports the driver has read (their keys are gone)
        self.draining = False
        self.drain_deadline: float | None = None
        self.heard_at = time.monotonic()   # the driver's last sealed ack of a beat
        self.ended: list[str] = []         # ids of this agent's workers that exited
        self.codes: dict[str, int] = {}    # ... and their exit codes (runner/outage.py)
        self.unread: dict[str, int] = {}   # ended id -> report it went in (0: not sent yet)
        self.acked_beat = 0
        self._signals: list[int] = []
        self.spares = Spares(cfg.command) if cfg.warm_spare else None
        self._spawned_at = 0.0             # when this agent last started a worker

    # -- joining --------------------------------------------------------------------
    def join(self) -> None:
        where = f"{self.cfg.driver_host}:{self.cfg.driver_port}"
        deadline = time.monotonic() + self.cfg.connect_timeout
        while not port_open(self.cfg.driver_host, self.cfg.driver_port):
            self._handle_signals(time.monotonic())
            if time.monotonic() > deadline:
                raise AgentFailed(f"cannot reach a driver at {where} within "
                                  f"{self.cfg.connect_timeout:g} s")
            time.sleep(0.5)
        try:
            # No retry inside calls: _wait_for_driver reconnects (or gives up) itself.
            self.store = protocol.open_link(self.cfg.driver_host, self.cfg.driver_port,
                                            self.cfg.connect_timeout, reconnect_within_s=0)
        except Exception:  # noqa: BLE001 - TCPStore raises several kinds on a dead address
            raise AgentFailed(f"cannot reach a driver at {where} within "
                              f"{self.cfg.connect_timeout:g} s") from None
        self._check_hello(where)
        self.control = ControlStore(self.store, self.secret)
        # A fresh random name, nothing shared to claim: an outsider cannot take it first.
        name = self.index = protocol.agent_name(self.secret, secrets.token_hex(16))
        self.control.put(AgentKeys.info(name), {"host": self.cfg.host_name,
                                                "slots": self.cfg.slots, "pid": os.getpid()},
                         keep=True)
        deadline = time.monotonic() + ACCEPT_WAIT_S
        while True:
            answer = self.control.get_object(AgentKeys.accepted(name))
            if answer is not None:
                break
            if time.monotonic() > deadline:
                raise AgentFailed(f"the driver at {where} did not answer the registration "
                                  f"within {ACCEPT_WAIT_S:g} s (is --secret-file "
                                  f"{self.cfg.secret_file} the job's secret?)")
            time.sleep(TICK_S)
            self.control.heal()       # the registration stays readable whatever overwrote it
        self.control.forget(AgentKeys.info(name))
        if not answer.get("ok"):
            raise AgentFailed(f"the driver at {where} refused this agent: "
                              f"{answer.get('reason', 'no reason given')}")
        self._beat()
        self.heard_at = time.monotonic()
        log.info("joined the driver at %s as %s with %d slot%s", where, self.cfg.host_name,
                 self.cfg.slots, "s" if self.cfg.slots != 1 else "")

    def _hello(self, store):
        """True when ``store`` carries a hello that proves the job secret."""
        try:
            hello = json.loads(bytes(store.get(protocol.HELLO_KEY))) \
                if store.check([protocol.HELLO_KEY]) else None
        except (ValueError, RuntimeError):
            return None
        if isinstance(hello, dict) and isinstance(hello.get("nonce"), str) and \
                hello.get("proof") == protocol.serve_proof(self.secret, hello["nonce"]):
            return True
        return False if hello is not None else None

    def _check_hello(self, where):
        deadline = time.monotonic() + HELLO_WAIT_S
        while True:
            hello = self._hello(self.store)
            if hello:
                return
            if time.monotonic() > deadline:
                if hello is None:
                    raise AgentFailed(f"{where} is not a serving elasticrun driver "
                                      "(no elasticrun --serve answered there)")
                raise AgentFailed(f"refused by the driver at {where}: its job secret is not "
                                  f"the one in --secret-file {self.cfg.secret_file}")
            time.sleep(TICK_S)

    # -- running --------------------------------------------------------------------
    def serve(self) -> int:
        """Until the driver says the job is over (0), or is lost, or we drained."""
        last_beat = 0.0
        while True:
            now = time.monotonic()
            self._handle_signals(now)
            try:
                if now - last_beat >= BEAT_S:
                    self._beat()
                    self.control.heal()     # reports an outsider overwrote come back
                    self._heard(now)
                    last_beat = now
                finished = self.control.get_object(AgentKeys.FINISHED)
                if finished is not None:
                    return self._finish(finished)
                self._take_requests()
                if self.spares is not None:
                    self.spares.read()      # before the reap: a forked worker's exit code
                self._reap()
                self._report()
                self._refill_spare(now)
            except (RuntimeError, ControlError, OSError):
                self._wait_for_driver()
            deadline = self.drain_deadline         # set when draining began
            if self.draining and (not self.workers or deadline is None
                                  or time.monotonic() > deadline):
                left = len(self.workers)
                self._stop_all(signal.SIGKILL)
                self._reap()
                self._flush_reports()
                log.info("drained: %s", "every worker left" if not left else
                         f"{left} worker(s) killed after --stop-timeout")
                return 0
            if time.monotonic() - self.heard_at > DRIVER_SILENT_S:
                self._wait_for_driver()
            time.sleep(TICK_S)

    def _heard(self, now, at_least=0):
        """The driver's ack of a newer beat of ours (at least beat ``at_least``): it is
        there. An outsider can neither seal one nor replay one for a beat not yet sent."""
        ack = self.control.get_object(AgentKeys.ack(self.index))
        if ack is not None and isinstance(ack.get("seq"), int) and \
                ack["seq"] > self.acked_beat and ack["seq"] >= at_least:
            self.acked_beat, self.heard_at = ack["seq"], now
            return True
        return False

    def _finish(self, finished):
        self._reap()
        self._stop_all(signal.SIGKILL)
        self._reap()
        self._report()
        self.control.put(AgentKeys.bye(self.index), {"seq": self.beat_seq})
        code = finished.get("code")
        log.info("the job is over (the driver exits with %s); agent exits", code)
        return 0 if code == 0 else 1

    def _wait_for_driver(self):
        """The driver stopped answering. Keep the workers (they train on) for up to
        --driver-grace after its last word; adopt a driver that comes back at the same
        address and proves the secret (the same one, or a restarted one); else stop the
        workers gracefully and give up."""
        where = f"{self.cfg.driver_host}:{self.cfg.driver_port}"
        grace = self.cfg.driver_grace
        log.warning("the driver at %s does not answer; keeping %d worker(s) for up to %g s "
                    "(--driver-grace)", where, len(self.workers), grace)
        nonce = secrets.token_hex(16)      # one per outage: a late answer still counts
        while time.monotonic() - self.heard_at < grace:
            self._handle_signals(time.monotonic())
            self._reap()
            if self.draining and (not self.workers or time.monotonic() > self.drain_deadline):
                return                     # the serve loop ends the drain
            if port_open(self.cfg.driver_host, self.cfg.driver_port) and self._reach(nonce):
                log.info("the driver at %s answers again; %d worker(s) kept", where,
                         len(self.workers))
                return
            time.sleep(BEAT_S)
        self._give_up(where)

    def _reach(self, nonce):
        """True once the driver at the address is ours again: the same one acks a beat,
        a restarted one accepts our registration (with our workers) again."""
        try:
            store = protocol.open_link(self.cfg.driver_host, self.cfg.driver_port, 5,
                                       reconnect_within_s=0)
            if not self._hello(store):
                return False               # not (yet) a driver that knows the secret
            self.store = store
            self.control.rebind(store)
            if self.control.present(AgentKeys.beat(self.index)):   # a restarted one has none
                self._beat()
                deadline = time.monotonic() + ANSWER_WAIT_S
                while time.monotonic() < deadline:
                    if self._heard(time.monotonic(), at_least=self.beat_seq):
                        return True        # the same driver: reports in flight are healed
                    time.sleep(TICK_S)
            return self._register_again(store, nonce)
        except (RuntimeError, ControlError, OSError, ValueError):
            return False

    def _register_again(self, store, nonce):
        """A restarted driver knows nothing of us: register with our live workers."""
        control = ControlStore(store, self.secret)      # the old driver's reports stay behind
        self._reap()                                    # only live workers are handed over
        workers = {wid: w.popen.pid for wid, w in self.workers.items()}
        control.put(AgentKeys.info(self.index), {
            "host": self.cfg.host_name, "slots": self.cfg.slots, "pid": os.getpid(),
            "workers": workers, "ended": self.ended, "codes": self.codes,
            "unread": sorted(self.unread), "nonce": nonce}, keep=True)
        deadline = time.monotonic() + ANSWER_WAIT_S
        while time.monotonic() < deadline:
            answer = control.get_object(AgentKeys.accepted(self.index))
            if answer is not None and answer.get("nonce") == nonce:
                control.forget(AgentKeys.info(self.index))
                if not answer.get("ok"):
                    self._stop_all(signal.SIGKILL)
                    raise AgentFailed(f"the restarted driver refused this agent: "
                                      f"{answer.get('reason', 'no reason given')}; workers "
                                      "stopped")
                # It read the unread exits in the registration.
                self.control, self.received, self.sent, self.acked, self.unread = control, 0, 0, 0, {}
                self._beat()
                self.heard_at = time.monotonic()
                return True
            time.sleep(TICK_S)
            control.heal()
        return False

    def _give_up(self, where):
        """No driver within the grace: the workers stop as on a SIGTERM (each writes its
        final checkpoint), then the agent exits with one line."""
        log.warning("no driver at %s for %g s: stopping %d worker(s)", where,
                    self.cfg.driver_grace, len(self.workers))
        for worker in self.workers.values():
            worker.kill(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.stop_timeout
        while self.workers and time.monotonic() < deadline:
            self._reap()
            time.sleep(TICK_S)
        self._stop_all(signal.SIGKILL)
        raise AgentFailed(f"lost contact with the driver at {where}: no driver came back "
                          f"within --driver-grace {self.cfg.driver_grace:g} s; workers stopped")

    def _beat(self, gone=False):
        self.beat_seq += 1
        self.control.put(AgentKeys.beat(self.index), {"seq": self.beat_seq,
                                                      "draining": self.draining,
                                                      "received": self.received,
                                                      "gone": gone})

    def _flush_reports(self):
        """Before a drained agent exits: its last reports (its workers' exits) reach the
        driver even if an outsider overwrote them, then the driver is told it is gone
        (so its host is not reported lost)."""
        deadline = time.monotonic() + FLUSH_WAIT_S
        try:
            self._report()
            while self.acked < self.sent and time.monotonic() < deadline:
                time.sleep(TICK_S)
                self._beat()
                self.control.heal()
                self._report()
            self._beat(gone=True)
        except (RuntimeError, ControlError, OSError):
            pass               # the driver is gone: nobody to tell

    def _take_requests(self):
        while True:
            key = AgentKeys.request(self.index, self.received + 1)
            message = self.control.get_object(key)
            if message is None:
                return
            self.received += 1      # the driver deletes it once a beat says so
            if message.get("op") == "spawn" and self.draining:
                self.outbox.exited(str(message.get("worker_id")), 0)   # never started: removed
            elif message.get("op") == "spawn":
                self.spawn_worker(str(message.get("worker_id")), message.get("env") or {})
            elif message.get("op") == "kill":
                worker = self.workers.get(str(message.get("worker_id")))
                if worker is not None:
                    worker.kill(int(message.get("signal", signal.SIGKILL)))

    def spawn_worker(self, worker_id: str, job_env: Mapping[str, str]) -> None:
        env = spawn_env.worker_env(job_env, log.warning, {
            "PYTHONUNBUFFERED": "1", protocol.ENV_ADDR: self.cfg.driver_host,
            protocol.ENV_SECRET: protocol.worker_key(self.secret),     # never the job secret
            protocol.ENV_DRIVER_PID: str(os.getpid()),
            protocol.ENV_DRIVER_GRACE: str(self.cfg.driver_grace)})
        self._spawned_at = time.monotonic()
        spare = self.spares.take(env) if self.spares is not None else None
        if self.spares is not None:
            self.spares.note_worker(env)
        if spare is not None:
            log.info("worker %s: the warm spare forks it", worker_id)
            self.workers[worker_id] = launcher.adopt_local(worker_id, self.cfg.host_name, spare,
                                                           self.sink)
            return
        try:
            self.workers[worker_id] = launcher.start_local(
                worker_id, self.cfg.host_name, self.cfg.command, env, self.sink)
        except OSError as exc:
            log.warning("cannot start %r: %s", self.cfg.command[0], exc.strerror)
            self.outbox.exited(worker_id, 127)

    def _refill_spare(self, now: float) -> None:
        """--warm-spare: start the spare once this host's workers have run a while (the
        agent cannot see the round; SPARE_AFTER_S keeps the spare off a round's start)."""
        if self.spares is None:
            return
        if self.draining or not self.workers or now - self._spawned_at < SPARE_AFTER_S:
            return
        if self.spares.refill():
            log.debug("a warm spare is starting")

    def _reap(self):
        for worker_id, worker in list(self.workers.items()):
            code = worker.poll()
            if code is not None:
                worker.join_output()
                del self.workers[worker_id]
                self.ended = (self.ended + [worker_id])[-1000:]   # ids a new driver must not reuse
                self.codes = {w: self.codes.get(w, code) for w in self.ended}
                self.unread[worker_id] = 0
                self.outbox.exited(worker_id, code)

    def _report(self):
        while True:
            out, exits = self.outbox.take()
            if not out and not exits:
                break
            self.sent += 1
            self.control.put(AgentKeys.report(self.index, self.sent),
                             {"out": out, "exits": exits}, keep=True)
            for worker_id, _ in exits:
                if worker_id in self.unread:
                    self.unread[worker_id] = self.sent
        if self.acked < self.sent:
            read = self.control.get_object(AgentKeys.read(self.index)) or {}
            upto = read.get("reports")
            while isinstance(upto, int) and self.acked < min(upto, self.sent):
                self.acked += 1
                key = AgentKeys.report(self.index, self.acked)
                self.control.forget(key)
                self.control.raw.delete_key(key)
            self.unread = {w: n for w, n in self.unread.items() if not 0 < n <= self.acked}

    def _stop_all(self, sig):
        for worker in self.workers.values():
            worker.kill(sig)
        deadline = time.monotonic() + 5
        while any(w.poll() is None for w in self.workers.values()) and \
                time.monotonic() < deadline:
            time.sleep(0.02)

    # -- signals --------------------------------------------------------------------
    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _handle_signals(self, now):
        while self._signals:
            signum = self._signals.pop(0)
            if self.draining or signum != signal.SIGTERM:
                self._stop_all(signal.SIGKILL)
                self._reap()
                self._report()
                raise AgentFailed(f"stopped by signal {signum}; workers killed")
            log.info("SIGTERM: draining %d worker(s), at most %g s", len(self.workers),
                     self.cfg.stop_timeout)
            self.draining = True
            self.drain_deadline = now + self.cfg.stop_timeout
            try:
                self._beat()
            except (RuntimeError, ControlError, OSError):
                pass               # the driver is away: it learns of it from our exits
            for worker in self.workers.values():
                worker.kill(signal.SIGTERM)


def port_open(host: str, port: int, timeout: float = 2.0) -> bool:
    """True when something accepts TCP connections at host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def run_agent(cfg: AgentConfig) -> int:
    """Join and serve; returns the exit code. Errors print one line, never a traceback."""
    try:
        agent = Agent(cfg)
        signal.signal(signal.SIGTERM, agent.on_signal)
        signal.signal(signal.SIGINT, agent.on_signal)
        agent.join()
        try:
            return agent.serve()
        finally:
            if agent.spares is not None:
                agent.spares.close()
    except AgentFailed as exc:
        sys.stderr.write(f"elasticrun: error: {exc}\n")
        return 1
