"""The simulated side of `make scale`: workers that speak the real control protocol
but train nothing, and the driver-side backend that starts them.

A simulated worker is the real ``elastic.worker.runtime.Worker`` (its rounds,
arrivals, heartbeat thread and store connections) with two things left out: it
forms no process group (``form_groups``) and it leaves with an exception instead
of ending its process. Many run as threads in a few processes. The commit's
collective, which hands rank 0's look at the store to every rank, is played by one
reader per process (``CommitBus``), so the store sees one look per process and
commit instead of one per worker.

The driver runs unchanged in its own process; ``SimCluster`` is its discovery
(a JSON file of hosts the harness rewrites) and its launcher (a queue per
simulated process), the way ``elasticrun --serve`` uses its joining agents.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time

from elastic import protocol
from elastic.exceptions import ElasticError
from elastic.protocol import ControlStore, Keys
from elastic.runner.discovery import Discovery
from elastic.runner.outage import Back
from elastic.worker.runtime import Worker

KILLED = -9          # the exit code of a worker the driver stopped (as for SIGKILL)
CRASHED = 1          # a worker the harness crashed
STARTERS = 4         # workers that start at once in one simulated process
POOLED = 64          # store connections its workers share


def sim_of(host: str, processes: int) -> int:
    """Which simulated process runs the workers of ``host`` ("sim-17")."""
    return int(host.rsplit("-", 1)[1]) % processes


# -- the driver's side -----------------------------------------------------------------------

class SimProc:
    """The driver's handle on one simulated worker (a launcher.WorkerProcess's methods)."""

    def __init__(self, cluster, worker_id, host):
        self._cluster = cluster
        self.worker_id = worker_id
        self.host = host
        self.code = None

    def poll(self):
        return self.code

    def kill(self, sig=None):
        if self.code is None:
            self._cluster.send(self.host, ("kill", self.worker_id))

    def join_output(self, timeout=2.0):
        """Simulated workers print nothing."""

    def describe_exit(self, code):
        return ""


class SimCluster(Discovery):
    """Hosts from a JSON file; workers started in the simulated processes."""

    def __init__(self, hosts_file, commands, exits):
        self.hosts_file = hosts_file
        self.commands = commands          # one multiprocessing queue per simulated process
        self.exits = exits                # (worker id, exit code) from every process
        self.procs = {}
        self._reader = threading.Thread(target=self._read_exits, daemon=True, name="sim-exits")
        self._reader.start()

    def discover(self):
        with open(self.hosts_file) as f:
            return {h: int(n) for h, n in json.load(f).items()}

    def attach(self, address, port, secret, sink):
        """The store address reaches the workers in their environment."""

    def owns(self, host):
        return True

    def take_adopted(self):
        return []          # a simulated driver is never restarted

    def outage_report(self):
        return Back()      # ... so no host ever reports an outage

    def take_failed_away(self):
        return []

    def send(self, host, command):
        self.commands[sim_of(host, len(self.commands))].put(command)

    def start(self, worker_id, host, env):
        proc = self.procs[worker_id] = SimProc(self, worker_id, host)
        self.send(host, ("spawn", worker_id, env))
        return proc

    def close(self, code=0):
        for q in self.commands:
            q.put(("quit",))

    def _read_exits(self):
        while True:
            worker_id, code = self.exits.get()
            proc = self.procs.get(worker_id)
            if proc is not None:
                proc.code = code


# -- the simulated processes -------------------------------------------------------------------

class Gone(Exception):
    """A simulated worker is not in the job any more."""


class SimWorker(Worker):
    beats_on_own_thread = False     # SimProcess.beat sends every worker's beats

    def __init__(self, env, pool):
        self._pool = pool
        self._sim_secret = protocol.read_secret_from_env(env)
        super().__init__(env)

    def new_control_connection(self, timeout=None, reconnect_within_s=None):
        """A ControlStore of its own over one of the process's pooled connections: the
        same requests and bytes, without thousands of TCP connects (on this machine
        about one TCPStore connect in 50 stalls for 5 s when many are made)."""
        store = self._pool[hash(self.worker_id) % len(self._pool)]
        return ControlStore(store, self._sim_secret)

    def form_groups(self, round_id):
        return None, None           # no model, no process group

    def leave_process(self, why):
        self.stop()
        raise Gone(why)


class CommitBus(threading.Thread):
    """Plays the commit's collective for every worker of this process: one look at the
    latest round and the stop key each ``every`` seconds."""

    def __init__(self, env, every):
        super().__init__(daemon=True, name="sim-commit-bus")
        store = protocol.connect(env[protocol.ENV_ADDR], env[protocol.ENV_PORT], 60)
        self.control = ControlStore(store, protocol.read_secret_from_env(env))
        self.every = every
        self.latest = 0
        self.stopping = False
        self.changed = threading.Event()     # replaced (and set) whenever what we saw changes

    def run(self):
        while True:
            try:
                value = self.control.get(Keys.LATEST_ROUND)
                stopping = self.control.get(Keys.STOP) is not None
            except Exception:  # noqa: BLE001 - the driver is gone; the workers notice too
                return
            latest = max(self.latest, int(value["round"])) if value is not None else self.latest
            if (latest, stopping) != (self.latest, self.stopping):
                self.latest, self.stopping = latest, stopping
                changed, self.changed = self.changed, threading.Event()
                changed.set()
            time.sleep(self.every)

    def next_change(self, round_id, timeout):
        """Block until a commit would see a round newer than ``round_id`` or the stop
        (a worker between changes only sleeps); (latest round, stopping)."""
        changed = self.changed
        if self.latest <= round_id and not self.stopping:
            changed.wait(timeout)
        return self.latest, self.stopping


class SimProcess:
    """One simulated process: a thread per worker, commands from the driver's backend."""

    def __init__(self, commands, exits, reports, commit_s):
        self.commands, self.exits, self.reports = commands, exits, reports
        self.commit_s = commit_s
        self.bus = None
        self.killed = {}            # worker id -> Event (set: stop with the code in codes)
        self.codes = {}
        self.workers = {}
        self.joins = []             # (worker id, round, requests, bytes read, seconds)
        self.lock = threading.Lock()
        self.starting = queue.SimpleQueue()
        self.ended = set()

    def serve(self):
        logging.getLogger().setLevel(logging.ERROR)
        threading.stack_size(512 * 1024)
        while True:
            command = self.commands.get()
            op = command[0]
            if op == "spawn":
                self.spawn(command[1], command[2])
            elif op in ("kill", "crash"):
                event = self.killed.get(command[1])
                if event is not None and not event.is_set():
                    # The process is gone at once, as after a signal: its thread only
                    # notices at its next wake-up and stays silent then.
                    self.codes[command[1]] = KILLED if op == "kill" else CRASHED
                    event.set()
                    with self.lock:
                        self.ended.add(command[1])
                    self.exits.put((command[1], self.codes[command[1]]))
            elif op == "stats":
                self.reports.put(self.stats())
            elif op == "quit":
                os._exit(0)

    def spawn(self, worker_id, env):
        if self.bus is None:
            self.pool = [protocol.connect(env[protocol.ENV_ADDR], env[protocol.ENV_PORT], 60)
                         for _ in range(POOLED)]
            self.bus = CommitBus(env, self.commit_s)
            self.bus.start()
            for _ in range(STARTERS):
                threading.Thread(target=self.start_workers, daemon=True,
                                 name="sim-starter").start()
            interval = float(env.get(protocol.ENV_HEARTBEAT_INTERVAL, 1.0))
            threading.Thread(target=self.beat, args=(interval,), daemon=True,
                             name="sim-heartbeat").start()
        self.killed[worker_id] = threading.Event()
        self.starting.put((worker_id, env))

    def start_workers(self):
        """A few workers start at a time: thousands of threads starting at once
        would starve this 2-core machine (on a cluster each has its own)."""
        while True:
            worker_id, env = self.starting.get()
            killed = self.killed[worker_id]
            try:
                w = SimWorker(env, self.pool)
            except Exception:  # noqa: BLE001 - the store is gone
                self.exits.put((worker_id, 1))
                continue
            with self.lock:
                self.workers[worker_id] = w
            threading.Thread(target=self.run_worker, args=(worker_id, w, killed), daemon=True,
                             name=f"sim-{worker_id}").start()

    def beat(self, interval):
        """Every live worker's heartbeat, each on its own connection as the real
        thread does, from one thread: a thread per worker would starve this machine.
        ``interval``: what the driver told the first worker (it slows beats in a big job)."""
        beat, failures = 0, {}
        while True:
            beat += 1
            began = time.monotonic()
            with self.lock:
                live = [(wid, w) for wid, w in self.workers.items()
                        if wid not in self.ended and not self.killed[wid].is_set()]
            for wid, w in live:
                try:
                    w.heartbeat.send(beat)
                    failures.pop(wid, None)
                except Exception:  # noqa: BLE001 - as the real thread: 3 in a row end it
                    failures[wid] = failures.get(wid, 0) + 1
                    if failures[wid] >= 3:
                        self.commands.put(("crash", wid))
            time.sleep(max(0.0, interval - (time.monotonic() - began)))

    def run_worker(self, worker_id, w, killed):
        code = 0
        try:
            while not killed.is_set():
                requests, read = w.control.requests, w.control.bytes_read
                began = time.monotonic()
                w.join_next_round()
                with self.lock:
                    self.joins.append((worker_id, w.round_id, w.control.requests - requests,
                                       w.control.bytes_read - read, time.monotonic() - began))
                while not killed.is_set():
                    latest, stopping = self.bus.next_change(w.round_id, self.commit_s * 4)
                    if stopping:
                        raise Gone("elasticrun is stopping")
                    if latest > w.round_id:
                        w.learn_latest(latest)   # as the commit's collective tells each rank
                        break            # a new round: rejoin, as HostsUpdatedInterrupt does
        except Gone:
            code = 0
        except ElasticError:
            code = 1
        except Exception:  # noqa: BLE001 - the driver went away
            code = 1
        finally:
            w.stop()
        if killed.is_set():
            return                  # its exit was reported when it was killed
        with self.lock:
            self.ended.add(worker_id)
        self.exits.put((worker_id, code))

    def stats(self):
        with self.lock:
            joins, self.joins = self.joins, []
            totals = [w.store_stats() for w in self.workers.values()]
        bus = (self.bus.control.requests, self.bus.control.bytes_read) if self.bus else (0, 0)
        return {"joins": joins, "requests": sum(t[0] for t in totals) + bus[0],
                "bytes_read": sum(t[1] for t in totals) + bus[1]}


def sim_main(commands, exits, reports, commit_s):
    """The entry point of one simulated process."""
    try:
        SimProcess(commands, exits, reports, commit_s).serve()
    except KeyboardInterrupt:
        os._exit(0)


def drain(q):
    """Everything in ``q`` now."""
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
