"""The status snapshot `elasticctl status` prints: what the driver knows, as JSON.

``StatusBoard`` listens to the driver's events (rounds, pauses, failures, progress)
and keeps the little history they carry; ``snapshot`` adds what the driver holds
now (members and their heartbeats, hosts, limits) and the checkpoint directory's
newest checkpoint. It is built on request (and once a second for --metrics-port),
so a job nobody watches pays nothing for it.
"""

from __future__ import annotations

import collections
import math
import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from elastic import protocol
from elastic.checkpoint import format as ckpt_format
from elastic.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from elastic.messages import Member
    from elastic.runner.driver import Driver
    from elastic.runner.job_config import JobConfig
    from elastic.runner.records import WorkerRecord

ROUNDS_SHOWN = 10
CHECKPOINT_LOOK_S = 5.0      # the checkpoint directory is listed at most this often
STALE_RATE_S = 5.0           # a commit rate reads 0 once no commit was seen for this long


class StatusBoard:
    """What the events of a job say, kept in bounded memory (an ``EventLog`` listener)."""

    def __init__(self) -> None:
        self.rounds: collections.deque[dict[str, Any]] = collections.deque(maxlen=ROUNDS_SHOWN)
        # rounds, pauses, failures, evictions, ...
        self.counts: collections.Counter[str] = collections.Counter()
        self.pause_seconds = 0.0              # over every measured pause
        self.last_pause: dict[str, Any] | None = None
        self.last_failure: dict[str, Any] | None = None
        self.progress: dict[str, Any] | None = None   # rank 0's latest report_progress, its rate
        self.world_size = 0

    def on_event(self, event: str, fields: Mapping[str, Any]) -> None:
        now = time.time()
        if event == "round_started":
            self.counts["rounds"] += 1
            self.world_size = fields.get("size", 0)
            self.rounds.append({"round": fields.get("round"), "size": self.world_size,
                                "change": fields.get("change"), "at": round(now, 3),
                                "pause_s": None})
        elif event == "pause":
            self.counts["pauses"] += 1
            seconds = float(fields.get("seconds", 0.0))
            self.pause_seconds += seconds
            self.last_pause = {"round": fields.get("round"), "seconds": seconds,
                               "at": round(now, 3)}
            for entry in self.rounds:
                if entry["round"] == fields.get("round"):
                    entry["pause_s"] = seconds
        elif event == "progress":
            self.progress = dict(fields, at=round(now, 3))
        elif event == "worker_failed":
            self.counts["failures"] += 1
            self.last_failure = {"reason": fields.get("reason"), "host": fields.get("host"),
                                 "at": round(now, 3)}
        elif event in ("worker_evicted", "host_preempted", "worker_removed", "host_blacklisted",
                       "host_drained"):
            self.counts[event.split("_", 1)[1]] += 1


class CheckpointProbe:
    """The newest checkpoint in a directory: version, bytes, age (read every few seconds)."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self._looked_at = -math.inf
        self._newest: tuple[int, dict[str, Any]] | None = None   # (version, body summary)

    def state(self, now: float) -> dict[str, Any] | None:
        if self.directory is None:
            return None
        if now - self._looked_at >= CHECKPOINT_LOOK_S:
            self._looked_at = now
            self._look()
        out: dict[str, Any] = {"dir": self.directory, "newest": None}
        if self._newest is not None:
            version, summary = self._newest
            out["newest"] = dict(summary, version=version,
                                 age_s=round(max(0.0, time.time() - summary["created"]), 1))
        return out

    def _look(self) -> None:
        directory = self.directory
        if directory is None:          # (state() looks only with a directory)
            return
        try:
            found = ckpt_format.list_checkpoints(directory) if os.path.isdir(directory) else []
        except (OSError, CheckpointError):
            return
        if not found or (self._newest and self._newest[0] == found[-1][0]):
            return
        version, path = found[-1]
        try:
            body = ckpt_format.read_manifest(path)
        except (OSError, CheckpointError):
            return
        blobs = body.get("blobs") or {}
        self._newest = (version, {"bytes": int(sum(blobs.values())),
                                  "created": float(body.get("created", 0.0))})


def member_line(member: Member, record: WorkerRecord | None, now: float) -> dict[str, Any]:
    """One member of the current round: its place and its heartbeats' news."""
    out = {"worker_id": member.worker_id, "host": member.host, "rank": member.rank,
           "local_rank": member.local_rank}
    if record is None:
        return dict(out, state="gone")
    live = record.liveness
    rate = live.commit_rate
    age = now - live.commit_at if live.commit_at else None
    if rate and age is not None and age > max(STALE_RATE_S, 3.0 / rate):
        rate = 0.0
    seconds = live.seconds or {}
    state = "leaving" if record.leaving is not None else ("stopped" if record.stopped else "training")
    return dict(out, state=state, commits=live.commit_count,
                commit_rate=None if rate is None else round(rate, 3),
                last_commit_s=None if age is None else round(age, 1),
                commit_s=seconds.get("commit"), sync_s=seconds.get("sync"))


def snapshot(driver: Driver, board: StatusBoard, probe: CheckpointProbe, drained: Iterable[str],
             now: float) -> dict[str, Any]:
    """The whole status as JSON-able data (``driver``: runner/driver.Driver)."""
    job, cfg, limits = driver.job, driver.cfg, driver.limits
    members = [member_line(m, driver.workers.get(m.worker_id), now) for m in job.members]
    in_round = job.member_set
    others = [{"worker_id": wid, "host": w.host,
               "state": "stopping" if w.stopped else ("ready" if w.ready else "starting")}
              for wid, w in driver.workers.items() if wid not in in_round]
    progress = None
    if board.progress is not None:
        progress = dict(board.progress, age_s=round(time.time() - board.progress["at"], 1))
    cooldowns = driver.hosts.cooldowns(now)
    return {
        "job": {"pid": os.getpid(), "command": list(cfg.command), "phase": job.phase.value,
                "round": job.round_id, "size": len(job.members), "resets": job.resets,
                "np": limits.np, "min_np": limits.min_np, "max_np": limits.max_np,
                "uptime_s": round(now - driver.started, 1),
                "stopping": driver.stop_signal is not None,
                "store": f"{driver.plane.binding.address}:{driver.store_port}"},
        "members": members,
        "other_workers": others,
        "rounds": list(board.rounds),
        "last_pause": board.last_pause,
        "counts": dict(board.counts),
        "last_failure": board.last_failure,
        "hosts": {"slots": driver.hosts.available(now),
                  "blacklisted": [{"host": h, "failures": driver.hosts.failures(h),
                                   "returns_in_s": None if math.isinf(t) else round(t, 1)}
                                  for h, t in cooldowns.items()],
                  "drained": sorted(drained), "preempted": sorted(job.preempted)},
        "checkpoint": probe.state(now),
        "progress": progress,
    }


def checkpoint_dir(cfg: JobConfig) -> str | None:
    """The job's --checkpoint-dir, if it has one (as the workers get it)."""
    return (cfg.extra_env or {}).get(protocol.ENV_CHECKPOINT_DIR)
