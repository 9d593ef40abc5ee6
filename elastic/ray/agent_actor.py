"""The Ray actor that is a joining agent on its node.

One per Ray node: it runs ``elasticrun --join``'s agent in-process, so the
node's workers are its children (they die with it, and the actor dies with
its node). The payload and the results live in the same path on every node:
the actor writes the payload there and hands the results back through Ray,
so no shared filesystem is needed.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import ray

import elastic
from elastic.ray.workdir import UnsafeWorkdir, place_payload, private_tree
from elastic.runner.agent import Agent, AgentConfig, AgentFailed


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(elastic.__file__)))


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)  # type: ignore[call-overload]
class AgentActor:
    def pid(self) -> int:
        return os.getpid()

    def run(self, spec: dict[str, Any]) -> tuple[int, str]:
        """Join the driver and run this node's workers until the job is over; the exit code."""
        workdir = spec["workdir"]
        try:
            private_tree(workdir, "results/errors")
            payload = place_payload(workdir, spec["payload"])
        except (UnsafeWorkdir, OSError) as exc:
            return 1, str(exc)
        fd, secret_file = tempfile.mkstemp(prefix="elastic-secret-")   # 0600
        with os.fdopen(fd, "w") as f:
            f.write(spec["secret"])
        parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if _package_root() not in parts:
            os.environ["PYTHONPATH"] = os.pathsep.join([_package_root()] + parts)
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        os.environ.update(spec.get("env") or {})          # RayExecutor(env=...) for the workers
        cfg = AgentConfig(
            driver_host=spec["driver_host"], driver_port=spec["driver_port"],
            secret_file=secret_file, host_name=spec["host_name"], slots=spec["slots"],
            command=[sys.executable, "-m", "elastic.launching.worker", payload,
                     os.path.join(workdir, "results")],
            connect_timeout=spec["connect_timeout"], stop_timeout=spec["stop_timeout"],
            quiet=True)     # the driver's console shows the output once
        try:
            agent = Agent(cfg)
            agent.join()
            return agent.serve(), ""
        except AgentFailed as exc:
            return 1, str(exc)
        finally:
            os.unlink(secret_file)

    def results(self, workdir: str) -> dict[str, bytes]:
        """{relative path: bytes} of the result and error files written on this node."""
        found = {}
        top = os.path.join(workdir, "results")
        for folder, _, names in os.walk(top):
            for name in names:
                if name.endswith((".pkl", ".json")):
                    path = os.path.join(folder, name)
                    with open(path, "rb") as f:
                        found[os.path.relpath(path, top)] = f.read()
        return found
