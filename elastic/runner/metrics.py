"""`elasticrun --metrics-port P`: the job's numbers for Prometheus (prometheus_client).

A collector reads, at each scrape, the status the driver's loop last summarised
(once a second, ``Exporter.update``) and the event counts of its ``StatusBoard``;
the scrape runs in prometheus_client's own HTTP thread and never touches the
driver's live tables. The registry is the exporter's own, so nothing else in the
process (or a second job in it) adds to or collides with these names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from elastic.exceptions import ElasticError

if TYPE_CHECKING:
    from elastic.runner.status import StatusBoard

PREFIX = "elastic_"


class MetricsError(ElasticError):
    """The endpoint cannot be served; str() is the one line the user sees."""


def summary(status: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    """The numbers the collector serves, from a status snapshot (status.snapshot)."""
    members = status["members"]
    commit = [m["commit_s"] for m in members if m.get("commit_s") is not None]
    sync = [m["sync_s"] for m in members if m.get("sync_s") is not None]
    rates = [m["commit_rate"] for m in members if m.get("commit_rate") is not None]
    progress = status.get("progress") or {}
    newest = (status.get("checkpoint") or {}).get("newest")
    values = {
        "world_size": len(members),
        "round": status["job"]["round"],
        "max_np": status["job"]["max_np"],
        "blacklisted_hosts": len(status["hosts"]["blacklisted"]),
        "drained_hosts": len(status["hosts"]["drained"]),
        "steps_per_second": progress.get("rate"),
        "commits_per_second": min(rates) if rates else None,   # the slowest member sets the pace
        "commit_seconds": max(commit) if commit else None,
        "sync_seconds": max(sync) if sync else None,
        "checkpoint_bytes": newest["bytes"] if newest else None,
        "checkpoint_age_seconds": newest["age_s"] if newest else None,
        "checkpoint_version": newest["version"] if newest else None,
    }
    scalars = {k: v for k, v in progress.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)
               and k not in ("rate", "at", "age_s", "round")}
    return values, scalars


GAUGES = {
    "world_size": "workers in the current round",
    "round": "the current round's number",
    "max_np": "the job's --max-np (0: no limit); elasticctl resize changes it",
    "blacklisted_hosts": "hosts barred now",
    "drained_hosts": "hosts elasticctl drain took out",
    "steps_per_second": "training steps per second (rank 0's elastic.report_progress)",
    "commits_per_second": "commits per second of the slowest member (heartbeats)",
    "commit_seconds": "the slowest member's last state.commit(), in seconds",
    "sync_seconds": "the slowest member's last state.sync(), in seconds",
    "checkpoint_bytes": "bytes of the newest checkpoint in --checkpoint-dir",
    "checkpoint_age_seconds": "age of the newest checkpoint in --checkpoint-dir",
    "checkpoint_version": "commit number of the newest checkpoint",
}
COUNTERS = {
    "rounds": "rounds published (membership changes + 1)",
    "pauses": "membership changes whose training pause rank 0 measured",
    "failures": "worker failures (exits, evictions), each blacklisting its host",
    "evicted": "workers evicted (silent, stalled or hung at start)",
    "preempted": "workers that got SIGTERM and left at a commit",
    "drained": "hosts drained with elasticctl",
}


class Exporter:
    """The HTTP endpoint and the collector behind it."""

    def __init__(self, port: int, board: StatusBoard, address: str = "0.0.0.0") -> None:
        try:
            import prometheus_client
            from prometheus_client.core import (
                CounterMetricFamily,
                GaugeMetricFamily,
                SummaryMetricFamily,
            )
        except ImportError:
            raise MetricsError("--metrics-port needs prometheus_client "
                               "(pip install prometheus_client)") from None
        self._families = (CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily)
        self.board = board
        self._latest: tuple[dict[str, Any], dict[str, float]] = ({}, {})
        self.registry = prometheus_client.CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        try:
            self._server, self._thread = prometheus_client.start_http_server(
                port, addr=address, registry=self.registry)
        except OSError as exc:
            raise MetricsError(f"--metrics-port {port}: cannot listen ({exc.strerror})") from None
        self.port = self._server.server_address[1]

    def update(self, status: Mapping[str, Any]) -> None:
        self._latest = summary(status)        # one reference swap: the scrape thread reads it

    def collect(self) -> Iterator[Any]:       # prometheus_client's metric families
        counter, gauge, summary_family = self._families
        values, scalars = self._latest
        for name, doc in GAUGES.items():
            value = values.get(name)
            if name == "max_np" and value is None:
                value = 0
            if value is not None:
                yield gauge(PREFIX + name, doc, value=float(value))
        counts = self.board.counts
        for name, doc in COUNTERS.items():
            yield counter(PREFIX + name, doc, value=float(counts.get(name, 0)))
        yield summary_family(PREFIX + "pause_seconds", "training paused per membership change",
                             count_value=int(counts.get("pauses", 0)),
                             sum_value=float(self.board.pause_seconds))
        family = gauge(PREFIX + "progress", "numbers rank 0 gave elastic.report_progress",
                       labels=["name"])
        for name, value in sorted(scalars.items()):
            family.add_metric([name], float(value))
        yield family

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
