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
from elastic.worker.runtime import Worker

KILLED = -9          # the exit code of a worker the driver stopped (as for SIGKILL)
CRASHED = 1          # a worker the harness crashed


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
        self.tick = threading.Condition()

    def run(self):
        while True:
            try:
                value = self.control.get(Keys.LATEST_ROUND)
                stopping = self.control.get(Keys.STOP) is not None
            except Exception:  # noqa: BLE001 - the driver is gone; the workers notice too
                return
            with self.tick:
                if value is not None:
                    self.latest = max(self.latest, int(value["round"]))
                self.stopping = stopping
                self.tick.notify_all()
            time.sleep(self.every)

    def next_commit(self, timeout):
        """Wait for the next look; (latest round, stopping)."""
        with self.tick:
            self.tick.wait(timeout)
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
                    self.codes[command[1]] = KILLED if op == "kill" else CRASHED
                    event.set()
            elif op == "stats":
                self.reports.put(self.stats())
            elif op == "quit":
                os._exit(0)

    def spawn(self, worker_id, env):
        if self.bus is None:
            self.bus = CommitBus(env, self.commit_s)
            self.bus.start()
        killed = self.killed[worker_id] = threading.Event()
        threading.Thread(target=self.run_worker, args=(worker_id, env, killed), daemon=True,
                         name=f"sim-{worker_id}").start()

    def run_worker(self, worker_id, env, killed):
        code = 0
        w = None
        try:
            w = SimWorker(env)
            with self.lock:
                self.workers[worker_id] = w
            while not killed.is_set():
                requests, read = w.control.requests, w.control.bytes_read
                began = time.monotonic()
                w.join_next_round()
                with self.lock:
                    self.joins.append((worker_id, w.round_id, w.control.requests - requests,
                                       w.control.bytes_read - read, time.monotonic() - began))
                while not killed.is_set():
                    latest, stopping = self.bus.next_commit(self.commit_s * 4)
                    if stopping:
                        raise Gone("elasticrun is stopping")
                    if latest > w.round_id:
                        break            # a new round: rejoin, as HostsUpdatedInterrupt does
        except Gone:
            code = 0
        except ElasticError:
            code = 1
        except Exception:  # noqa: BLE001 - the driver went away
            code = 1
        finally:
            if w is not None:
                w.stop()
        if killed.is_set():
            code = self.codes.get(worker_id, KILLED)
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
