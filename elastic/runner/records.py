"""What the driver keeps about each live worker process, and what one tick saw."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.runner.decisions import WorkerView
from elastic.runner.stalls import Liveness


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
    liveness: Liveness = field(default_factory=Liveness)   # __post_init__ sets its clock
    leaving: dict | None = None       # its SIGTERM report (Keys.leaving)
    leaving_since: float | None = None

    def __post_init__(self) -> None:
        self.liveness = Liveness(beat_at=self.started, progress_at=self.started)

    def view(self) -> WorkerView:
        return WorkerView(self.worker_id, self.host, self.slot, self.started, ready=self.ready,
                          stopped=self.stopped, beats=self.heartbeat,
                          heartbeat_at=self.heartbeat_at, liveness=self.liveness,
                          leaving=self.leaving, leaving_since=self.leaving_since)


@dataclass
class Observed:
    """What one tick saw, before deciding whether ``decide`` needs to run."""
    exits: list
    liveness_checked: bool
    failure_reports: dict             # worker id -> error text, of the current round
    joined: int
    unready: int                      # live workers neither ready nor stopped
    replaced_failed: tuple = ()       # replaced, unaborted rounds whose failure doorbell rang
