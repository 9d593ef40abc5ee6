"""Watching and steering a running job: the driver's end of `elasticctl` (issue 30).

``Watch`` is made once the control store listens. It leaves a job file for
elasticctl (runner/jobfiles.py), answers its sealed requests from the store
(runner/steering.py) with a status snapshot (runner/status.py) or by steering the
job, and feeds the optional Prometheus endpoint and TensorBoard writer. Steering
reaches ``policy.decide`` only as facts: drained hosts (``Facts.drained``), a new
``Limits.max_np``, or the same stop a SIGTERM to elasticrun starts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
from typing import TYPE_CHECKING, Any

from elastic.exceptions import ElasticError
from elastic.runner import jobfiles, steering
from elastic.runner.metrics import Exporter, MetricsError
from elastic.runner.status import CheckpointProbe, StatusBoard, checkpoint_dir, snapshot
from elastic.runner.tensorboard_log import ScalarLog, TensorBoardError

if TYPE_CHECKING:
    from elastic.runner.driver import Driver

log = logging.getLogger("elasticrun")
METRICS_EVERY_S = 1.0


class WatchError(ElasticError):
    """--metrics-port or --tensorboard cannot start; str() is the one line."""


class Watch:
    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        cfg = driver.cfg
        self.board = StatusBoard()
        self.probe = CheckpointProbe(checkpoint_dir(cfg))
        self.drained: frozenset[str] = frozenset()
        self.metrics: Exporter | None = None
        self.scalars: ScalarLog | None = None
        self.job_file: str | None = None
        self._summarised_at = -math.inf
        try:
            if cfg.metrics_port is not None:
                self.metrics = Exporter(cfg.metrics_port, self.board)
                log.info("metrics for Prometheus at http://0.0.0.0:%d/metrics", self.metrics.port)
            if cfg.tensorboard:
                self.scalars = ScalarLog(cfg.tensorboard)
        except (MetricsError, TensorBoardError) as exc:
            self.close()
            raise WatchError(str(exc)) from None
        listeners = driver.events.listeners
        listeners.append(self.board.on_event)
        if self.scalars is not None:
            listeners.append(self.scalars.on_event)
        self.inbox = steering.open_inbox(driver.plane, driver.secret)
        try:
            self.job_file = jobfiles.write({
                "address": driver.plane.binding.local_connect_address(),
                "port": driver.store_port, "secret": driver.secret,
                "command": list(cfg.command)})
        except OSError as exc:
            log.warning("no job file for elasticctl (%s); use elasticctl --addr with "
                        "--secret-file", exc.strerror or exc)

    def status(self, now: float) -> dict[str, Any]:
        status = snapshot(self.driver, self.board, self.probe, self.drained, now)
        if self.metrics is not None:
            status["job"]["metrics_port"] = self.metrics.port
        return status

    def tick(self, now: float) -> bool:
        """Answer elasticctl; True when a request steered the job (decide must look)."""
        steered = False
        for name, request in self.inbox.poll(now):
            reply, moved = self.handle(request, now)
            self.inbox.reply(name, reply, now)
            steered = steered or moved
        if self.metrics is not None and now - self._summarised_at >= METRICS_EVERY_S:
            self._summarised_at = now
            self.metrics.update(self.status(now))
        return steered

    def handle(self, request: dict[str, Any], now: float) -> tuple[dict[str, Any], bool]:
        """(the reply, whether the job was steered) for one verified request."""
        op, driver = request["op"], self.driver
        if op == "status":
            return {"ok": True, "status": self.status(now)}, False
        if op == "stop":
            if driver.stop_signal is not None or driver.job.stop_signal is not None:
                return {"ok": True, "message": "the job is stopping already"}, False
            log.info("elasticctl stop: stopping as for SIGTERM")
            driver.events.emit("stop_requested", by="elasticctl")
            driver.request_stop(signal.SIGTERM)
            return {"ok": True, "message": "stopping: every worker stops at its next commit"}, True
        if op == "drain":
            host = request["host"]
            if host in self.drained:
                return {"ok": True, "message": f"host {host} is drained already"}, False
            why = steering.drain_refusal(host, driver.hosts.available(now), self.drained,
                                         driver.limits.min_np)
            if why:
                return {"ok": False, "error": why}, False
            self.drained = self.drained | {host}
            log.info("elasticctl drain %s: its workers leave at the next commit", host)
            driver.events.emit("host_drained", host=host)
            return {"ok": True, "message": f"draining {host}: its workers leave at the next "
                                           "commit"}, True
        why = steering.resize_refusal(request["max_np"], driver.limits.min_np)
        if why:
            return {"ok": False, "error": why}, False
        old, new = driver.limits.max_np, request["max_np"]
        driver.limits = dataclasses.replace(driver.limits, max_np=new)
        log.info("elasticctl resize: --max-np %s -> %d", old, new)
        driver.events.emit("max_np_changed", old=old, new=new)
        return {"ok": True, "message": f"--max-np is now {new} (was {old})"}, True

    def close(self) -> None:
        if self.job_file is not None:
            jobfiles.remove(self.job_file)
            self.job_file = None
        if self.metrics is not None:
            self.metrics.close()
        if self.scalars is not None:
            self.scalars.close()
