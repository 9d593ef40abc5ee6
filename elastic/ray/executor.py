"""``RayExecutor``: run a function as an elastic job on a Ray cluster.

The driver is ``elasticrun --serve`` in a child process of the caller (as
``elastic.launch`` runs it), and every Ray node with room for a worker gets
one agent actor (elastic/ray/agent_actor.py) that joins it. A watcher
thread follows ``ray.nodes()``: a node the autoscaler adds gets an agent, so
the job grows at its next commit; a node that goes away takes its actor and
workers with it, which the driver sees as a lost host (a failure). The
driver's policy (min/max np, blacklist, reset limit) is elasticrun's own.

A node whose agent died is not given a new one during this run: like a
blacklisted host without a cooldown, it stays out.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import secrets
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, cast

import cloudpickle

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("elastic.ray needs ray: pip install 'elastic-train[ray]'") from exc

from elastic.launching import client
from elastic.ray.agent_actor import AgentActor
from elastic.ray.workdir import private_tree

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

log = logging.getLogger("elastic.ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RayExecutor:
    """An elastic job whose workers run on Ray nodes.

    ``min_np``/``max_np``: fewest and most workers (elasticrun's --min-np and
    --max-np); ``np``: workers to start with (default ``min_np``).
    ``cpus_per_worker``/``gpus_per_worker``: what one worker needs; a node's
    slots are how many workers its resources hold, and its agent reserves them.
    ``watch_interval``: seconds between looks at the cluster's nodes.
    Other keyword arguments are elasticrun flags, as for ``elastic.launch``
    (``elastic_timeout=60``, ``reset_limit=3``, ``worker_timeout=10``).
    """

    def __init__(self, min_np: int = 1, max_np: int | None = None, cpus_per_worker: float = 1,
                 gpus_per_worker: float = 0, np: int | None = None,
                 watch_interval: float = 1.0, timeout: float | None = None, quiet: bool = False,
                 env: Mapping[str, str] | None = None, **elasticrun_options: Any) -> None:
        for name, value in (("cpus_per_worker", cpus_per_worker),
                            ("gpus_per_worker", gpus_per_worker)):
            if not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if not cpus_per_worker and not gpus_per_worker:
            raise ValueError("give cpus_per_worker or gpus_per_worker (a worker needs something)")
        self.np = min_np if np is None else np
        self.flags = client.elasticrun_flags(self.np, min_np, max_np, None, None,
                                             elasticrun_options)
        client.validate_flags(self.flags)     # as elastic.launch and elasticrun check them
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.watch_interval = watch_interval
        self.timeout = timeout
        self.quiet = quiet
        self.env = dict(env or {})
        self.stop_timeout = float(elasticrun_options.get("stop_timeout", 20.0))
        self._agents: dict[str, tuple[ActorHandle, ObjectRef]] = {}   # node id -> (actor, run ref)
        self._dead: set[str] = set()         # node ids whose agent died
        self._lock = threading.Lock()

    def agents(self) -> dict[str, ActorHandle]:
        """{Ray node id: agent actor} of the running job (an actor's ``pid`` method
        gives its process id)."""
        with self._lock:
            return {node: actor for node, (actor, _) in self._agents.items()}

    # -- nodes -> agents --------------------------------------------------------------
    def slots_of(self, resources: Mapping[str, float]) -> int:
        """How many workers a node with ``resources`` (Ray's dict) holds."""
        fits = []
        if self.cpus_per_worker:
            fits.append(int(resources.get("CPU", 0) // self.cpus_per_worker))
        if self.gpus_per_worker:
            fits.append(int(resources.get("GPU", 0) // self.gpus_per_worker))
        return min(fits)

    def _watch(self, spec: dict[str, Any], stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self._place_agents(spec)
                self._notice_deaths()
            except Exception as exc:  # noqa: BLE001 - a Ray hiccup must not end watching
                log.warning("elastic.ray: watching the cluster failed: %s", exc)
            stop.wait(self.watch_interval)

    def _place_agents(self, spec: dict[str, Any]) -> None:
        for node in ray.nodes():
            node_id = node["NodeID"]
            if not node.get("Alive") or node_id in self._agents or node_id in self._dead:
                continue
            slots = self.slots_of(node.get("Resources", {}))
            if slots < 1:
                continue
            # ray.remote made the class an ActorClass, which ray's hints do not say
            actor = AgentActor.options(  # type: ignore[attr-defined]
                num_cpus=slots * self.cpus_per_worker, num_gpus=slots * self.gpus_per_worker,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote()
            name = f"ray-{node_id[:12]}"
            ref = actor.run.remote(dict(spec, host_name=name, slots=slots))
            with self._lock:
                self._agents[node_id] = (actor, ref)

    def _notice_deaths(self) -> None:
        with self._lock:
            refs = {ref: node for node, (_, ref) in self._agents.items()}
        if not refs:
            return
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in done:
            node = refs[ref]
            try:
                code, why = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - RayActorError and its kin: the actor died
                code, why = None, f"{type(exc).__name__}"
            if code != 0 and node not in self._dead:
                log.warning("elastic.ray: the agent on node %s ended: %s", node[:12],
                            why or f"exit code {code}")
            with self._lock:
                self._dead.add(node)
                if code is None:
                    self._agents.pop(node, None)

    # -- running ------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple[Any, ...] | list[Any] = (),
            kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every worker; the final round's results by rank."""
        if not callable(fn):
            raise TypeError(f"run() needs a callable, got {type(fn).__name__}")
        if not ray.is_initialized():
            ray.init()
        payload = pickle.dumps({"sys_path": client.worker_sys_path(),
                                "call": cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))},
                               protocol=pickle.HIGHEST_PROTOCOL)
        tmp = tempfile.mkdtemp(prefix="elastic-ray-")
        secret = secrets.token_hex(32)
        secret_file = os.path.join(tmp, "secret")
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret)
        port = _free_port()
        logs, events = os.path.join(tmp, "logs"), os.path.join(tmp, "events.jsonl")
        argv = [sys.executable, "-m", "elastic.runner", "--serve", "--port", str(port),
                "--secret-file", secret_file, *self.flags, "--output-filename", logs,
                "--event-log", events]
        spec = {"workdir": tmp, "payload": payload, "secret": secret, "driver_port": port,
                "driver_host": ray.util.get_node_ip_address(), "connect_timeout": 120.0,
                "stop_timeout": self.stop_timeout, "env": self.env}
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(spec, stop), daemon=True,
                                   name="elastic-ray-watch")
        watcher.start()
        try:
            code, driver_log = client.run_elasticrun(argv, client.child_env(self.env),
                                                     self.timeout, self.quiet)
            stop.set()
            watcher.join(10)
            self._collect(tmp)
            job = client.Outcome(os.path.join(tmp, "results"), logs, events, driver_log)
            if code is None:
                raise job.error(f"timed out after {self.timeout:g} s; the job was stopped", None)
            return job.results(code)
        finally:
            stop.set()
            for actor, _ in list(self._agents.values()):
                ray.kill(actor)
            self._agents.clear()
            self._dead.clear()
            shutil.rmtree(tmp, ignore_errors=True)

    def _collect(self, tmp: str) -> None:
        """Bring the result files of every node here (they are written where the worker ran)."""
        top = os.path.join(tmp, "results")
        for actor, _ in list(self._agents.values()):
            try:
                files = cast("dict[str, bytes]",      # what AgentActor.results returns
                             ray.get(actor.results.remote(tmp), timeout=60))
            except Exception:  # noqa: BLE001 - a dead node's results were not final anyway
                continue
            for rel, data in files.items():
                path = os.path.join(top, rel)
                if not os.path.exists(path):
                    private_tree(tmp, os.path.relpath(os.path.dirname(path), tmp))
                    with open(path, "wb") as f:
                        f.write(data)
