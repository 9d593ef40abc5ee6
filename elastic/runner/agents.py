"""The serving driver's side of joining agents: a discovery source and a launcher.

In ``elasticrun --serve`` nothing is launched from the driver. Agents
(``elasticrun --join``) register their host and slots in the store; this hub
turns the live ones into discovered hosts, so the driver's policy (min/max np,
blacklist, cooldown, reset limit) applies to them unchanged. When the driver
places a worker on an agent's host, the hub writes a signed spawn request for
that agent and hands the driver a process handle whose exit code, output and
kill travel through the store too.

An agent whose heartbeat stops is lost: it leaves discovery and each of its
workers reads as exited with ``AGENT_LOST``, which the driver treats as any
failed worker (its host is blacklisted). An agent that is draining (SIGTERM)
leaves discovery at once, so the driver re-forms the round without it.

Registrations are found by listing keys, not by a shared counter or slot list:
an agent names itself with a random token and its tag (protocol.agent_name),
so an outsider has nothing to squat, and names whose tag does not verify are
dropped without a store read. The listing runs on its own connection and
thread, so an outsider flooding the store with keys slows joining down, never
the polling of agents already in.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic import protocol
from elastic.protocol import AgentKeys, ControlStore
from elastic.runner.discovery import Discovery
from elastic.runner.outage import Back, blamed

if TYPE_CHECKING:
    from elastic.runner.interfaces import WorkerHandle
    from elastic.runner.launcher import OutputSink

log = logging.getLogger("elasticrun")
POLL_S = 0.1
SCAN_S = 0.5               # how often registrations are listed
HELLO_REFRESH_S = 0.5      # an outsider's hello lasts this long at most
AGENT_LOST = 137           # what a lost agent's workers read as (128 + SIGKILL)
_NOT_SENT = {protocol.ENV_SECRET, protocol.ENV_SECRET_FILE, protocol.ENV_ADDR,
             protocol.ENV_DRIVER_PID}


@dataclass
class _Agent:
    index: str             # its name in the store (protocol.agent_name)
    host: str
    slots: int
    seen: float
    seq: int = 0
    draining: bool = False
    lost: bool = False
    sent: int = 0          # requests written
    acked: int = 0         # requests the agent has read (their keys are gone)
    received: int = 0      # reports read
    workers: dict[str, AgentWorker] = field(default_factory=dict)


class AgentWorker:
    """The driver's handle on a worker that an agent runs (same methods as a
    launcher.WorkerProcess)."""

    def __init__(self, hub: AgentHub, agent: _Agent, worker_id: str) -> None:
        self._hub = hub
        self._agent = agent
        self.worker_id = worker_id
        self.host = agent.host
        self.code: int | None = None
        self.lost_after: float | None = None

    def poll(self) -> int | None:
        return self.code

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.code is None:
            self._hub.request(self._agent, {"op": "kill", "worker_id": self.worker_id,
                                            "signal": int(sig)})

    def join_output(self, timeout: float = 2.0) -> None:
        """Output before the exit arrived in earlier (or the same) reports: nothing to wait for."""

    def describe_exit(self, code: int) -> str:
        if self.lost_after is not None:
            return (f" (its agent on {self.host} was lost: no heartbeat for "
                    f"{self.lost_after:.0f} s)")
        return ""


class AgentHub(Discovery):
    """Discovery of, and launching through, the agents that joined this driver."""

    def __init__(self, timeout_s: float = 30.0, sink: OutputSink | None = None) -> None:
        self.timeout_s = timeout_s
        self.sink = sink
        self._agents: dict[str, _Agent] = {}          # name -> _Agent
        self._pending: set[str] = set()      # names listed whose registration is not answered yet
        self._registrations: _Registrations | None = None
        # (worker id, host, handle) of live workers agents brought
        self._adopted: list[tuple[str, str, WorkerHandle | None]] = []
        self._back = Back()        # what agents reported about the time no driver ran
        # (worker id, host, code): failed, no driver read the exit
        self._failed_away: list[tuple[str, str, int]] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.control: ControlStore | None = None

    # -- wiring by the driver ---------------------------------------------------------
    def attach(self, address: str, port: int, secret: str, sink: OutputSink) -> None:
        """Start serving agents on the driver's store (the driver calls this once it listens)."""
        store = protocol.open_link(address, port, 30)
        self._secret = secret
        self._raw = store
        self.control = ControlStore(store, secret)
        self.sink = sink
        self._publish_hello()
        self._registrations = _Registrations(protocol.open_link(address, port, 30), secret,
                                             self._stop)
        self._registrations.start()
        self._thread = threading.Thread(target=self._run, name="elastic-agents", daemon=True)
        self._thread.start()

    def close(self, code: int = 0, wait_s: float = 5.0) -> None:
        """Tell every agent the job is over and give them a moment to see it
        (they exit cleanly instead of reporting a lost driver)."""
        self._stop.set()
        for thread in (self._thread, self._registrations):
            if thread is not None:
                thread.join(2.0)
        if self.control is None:
            return
        try:
            with self._lock:
                self.control.put(AgentKeys.FINISHED, {"code": int(code)}, keep=True)
                live = [a.index for a in self._agents.values() if not a.lost]
            deadline = time.monotonic() + wait_s
            while live and time.monotonic() < deadline:
                live = [i for i in live if not self.control.has(AgentKeys.bye(i))]
                self.control.heal()
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - agents also notice the driver is gone
            pass

    # -- discovery ------------------------------------------------------------------
    def discover(self) -> dict[str, int]:
        with self._lock:
            return {a.host: a.slots for a in self._agents.values()
                    if not a.lost and not a.draining}

    # -- launcher backend -----------------------------------------------------------------
    def owns(self, host: str) -> bool:
        with self._lock:
            return any(a.host == host for a in self._agents.values())

    def start(self, worker_id: str, host: str, env: Mapping[str, str]) -> AgentWorker:
        """Ask ``host``'s agent to start a worker with the job part of ``env``."""
        with self._lock:
            agent = self._live_agent(host)
            handle = AgentWorker(self, agent, worker_id)
            if agent.lost:
                handle.code, handle.lost_after = AGENT_LOST, self.timeout_s
                return handle
            agent.workers[worker_id] = handle
            sent = {k: v for k, v in env.items() if k not in _NOT_SENT}
            self.request(agent, {"op": "spawn", "worker_id": worker_id, "env": sent})
            return handle

    def request(self, agent: _Agent, message: dict[str, Any]) -> None:
        with self._lock:
            agent.sent += 1
            try:
                control = self.control
                assert control is not None, "attach() comes first"
                control.put(AgentKeys.request(agent.index, agent.sent), message,
                                 keep=True)    # healed until the agent says it read it
            except Exception as exc:  # noqa: BLE001 - our own store: only a shutdown fails
                log.debug("cannot send a request to agent %s: %s", agent.host, exc)

    def take_adopted(self) -> list[tuple[str, str, WorkerHandle | None]]:
        """Workers that agents still run from before this driver started (a restart):
        [(worker id, host, handle)], each once."""
        with self._lock:
            adopted, self._adopted = self._adopted, []
        return adopted

    def outage_report(self) -> Back:
        """What the agents registered so far said (outage.Back)."""
        with self._lock:
            return self._back

    def take_failed_away(self) -> list[tuple[str, str, int]]:
        """(worker id, host, code) of workers that failed while no driver read their exit
        (outage.blamed), each once."""
        with self._lock:
            failed, self._failed_away = self._failed_away, []
        return failed

    def _live_agent(self, host):
        matches = [a for a in self._agents.values() if a.host == host]
        live = [a for a in matches if not a.lost]
        return (live or matches)[-1]

    # -- polling ----------------------------------------------------------------------
    def _run(self):
        last_hello = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                with self._lock:
                    if now - last_hello > HELLO_REFRESH_S:
                        self._publish_hello()
                        self.control.heal()     # answers an outsider overwrote
                        last_hello = now
                    self._scan(now)
                    for agent in list(self._agents.values()):
                        if not agent.lost:
                            self._poll_agent(agent, now)
            except Exception as exc:  # noqa: BLE001 - a store hiccup must not end polling
                log.debug("agent polling: %s", exc)
            self._stop.wait(POLL_S)

    def _publish_hello(self):
        """Re-published now and then, so one write by an outsider cannot turn agents away."""
        nonce = secrets.token_hex(16)
        proof = protocol.serve_proof(self._secret, nonce)
        self._raw.set(protocol.HELLO_KEY, f'{{"nonce":"{nonce}","proof":"{proof}"}}')

    def _scan(self, now):
        self._pending.update(self._registrations.take())
        for name in sorted(self._pending):
            info = self.control.get_object(AgentKeys.info(name))
            if info is None:
                continue       # not readable yet, or overwritten: the agent puts it back
            self._pending.discard(name)
            self._admit(name, info, now)

    def _admit(self, name, info, now):
        """Answer a registration; the answer is kept (healed) until the agent beats."""
        host, slots = info.get("host"), info.get("slots")
        if not (isinstance(host, str) and host and isinstance(slots, int) and slots >= 1):
            self.control.put(AgentKeys.accepted(name), {"ok": False,
                                                        "reason": "malformed registration"},
                             keep=True)
            return
        taken = [a for a in self._agents.values() if a.host == host and not a.lost]
        if taken:
            reason = f"host name {host!r} is in use by another live agent; give --host-name"
            self.control.put(AgentKeys.accepted(name), {"ok": False, "reason": reason},
                             keep=True)
            log.warning("agent on %s refused: %s", host, reason)
            return
        agent = self._agents[name] = _Agent(name, host, slots, seen=now)
        answer = {"ok": True}
        workers = info.get("workers")
        if isinstance(workers, dict):         # a restarted driver: the agent kept these
            answer["nonce"] = str(info.get("nonce"))
            for wid in sorted((w for w in workers if str(w).isdigit()), key=int)[:slots]:
                handle = agent.workers[wid] = AgentWorker(self, agent, wid)
                self._adopted.append((wid, host, handle))
            ended = info.get("ended")           # ids no new worker may take (None: no handle)
            self._adopted += [(str(w), host, None) for w in ended[:1000]
                              if str(w).isdigit()] if isinstance(ended, list) else []
            self._take_codes(host, info.get("codes"), info.get("unread"), agent.workers)
        self._back = dataclasses.replace(self._back, hosts=self._back.hosts | {host})
        self.control.put(AgentKeys.accepted(name), answer, keep=True)
        log.info("agent %s: %s with %d slot%s%s", "joined" if workers is None else "is back",
                 host, slots, "s" if slots != 1 else "",
                 "" if workers is None else f" and {len(agent.workers)} live worker(s)")

    def _take_codes(self, host, codes, unread, live):
        """The exit codes of an agent's ended workers, and which no driver read."""
        codes = {str(w): c for w, c in list(codes.items())[:1000] if str(w).isdigit()
                 and isinstance(c, int) and not isinstance(c, bool)} \
            if isinstance(codes, dict) else {}
        unread = {str(w) for w in unread[:1000]} if isinstance(unread, list) else set()
        self._failed_away += blamed(codes, unread, dict.fromkeys(codes, host))
        self._back = Back(self._back.hosts, self._back.live | set(live),
                          {**self._back.codes, **codes})

    def _poll_agent(self, agent, now):
        beat = self.control.get_object(AgentKeys.beat(agent.index))
        if beat is not None and isinstance(beat.get("seq"), int) and beat["seq"] > agent.seq:
            if not agent.seq:
                self.control.forget(AgentKeys.accepted(agent.index))   # it read the answer
            agent.seq, agent.seen = beat["seq"], now
            self.control.put(AgentKeys.ack(agent.index), {"seq": agent.seq})   # we are here
            self._drop_requests(agent, beat.get("received"))
            if beat.get("draining") and not agent.draining:
                agent.draining = True
                log.info("agent on %s is draining (SIGTERM): its host leaves the job",
                         agent.host)
        self._read_reports(agent)
        gone = beat is not None and beat.get("gone") and agent.draining
        if gone:
            log.info("agent on %s drained and left", agent.host)
        elif now - agent.seen > self.timeout_s:
            log.warning("agent on %s sent no heartbeat for %.0f s; its host is lost",
                        agent.host, self.timeout_s)
        else:
            return
        agent.lost = True
        self._drop_requests(agent, agent.sent)
        for handle in agent.workers.values():
            if handle.code is None:
                handle.code, handle.lost_after = AGENT_LOST, self.timeout_s

    def _drop_requests(self, agent, received):
        """Requests the agent has read need no healing any more: forget and delete them."""
        if not isinstance(received, int):
            return
        while agent.acked < min(received, agent.sent):
            agent.acked += 1
            key = AgentKeys.request(agent.index, agent.acked)
            self.control.forget(key)
            self.control.raw.delete_key(key)

    def _read_reports(self, agent):
        before = agent.received
        while True:
            key = AgentKeys.report(agent.index, agent.received + 1)
            report = self.control.get_object(key)
            if report is None:
                break
            agent.received += 1
            self._take_report(agent, report)
        if agent.received != before:      # the agent heals its reports until it reads this
            self.control.put(AgentKeys.read(agent.index), {"reports": agent.received},
                             keep=True)

    def _take_report(self, agent, report):
        """Output to the console, exits to the handles (only of workers it runs)."""
        by_stream = {}
        for item in report.get("out", ()):
            if isinstance(item, list) and len(item) == 3 and item[0] in agent.workers:
                wid, stream, line = item
                by_stream.setdefault((wid, "stderr" if stream == "stderr" else "stdout"),
                                     []).append(str(line))
        if self.sink is not None:
            for (wid, stream), lines in by_stream.items():
                self.sink.write_lines(wid, stream, lines)
        for item in report.get("exits", ()):
            if isinstance(item, list) and len(item) == 2 and item[0] in agent.workers \
                    and isinstance(item[1], int):
                agent.workers.pop(item[0]).code = item[1]
                if item[0] in self._back.live:          # adopted, then ended (outage.py)
                    self._back = Back(self._back.hosts, self._back.live - {item[0]},
                                      {**self._back.codes, item[0]: item[1]})


class _Registrations(threading.Thread):
    """Lists agent registrations on its own connection; hands over each verified name once."""

    def __init__(self, store, secret, stop):
        super().__init__(name="elastic-agent-registrations", daemon=True)
        self._control = ControlStore(store, secret)
        self._secret = secret
        self._halt = stop
        self._seen = set()
        self._new = []
        self._lock = threading.Lock()

    def run(self):
        while not self._halt.is_set():
            try:
                keys = self._control.keys()
            except Exception as exc:  # noqa: BLE001 - a store hiccup must not end listing
                log.debug("listing agent registrations: %s", exc)
                keys = ()
            names = {AgentKeys.registered(k) for k in keys} - self._seen - {None}
            fresh = [n for n in names if protocol.is_agent_name(self._secret, n)]
            if fresh:
                self._seen.update(fresh)
                with self._lock:
                    self._new.extend(fresh)
            self._halt.wait(SCAN_S)

    def take(self):
        with self._lock:
            new, self._new = self._new, []
        return new
