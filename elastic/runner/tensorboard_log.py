"""`elasticrun --tensorboard DIR`: the job's scalars as TensorBoard event files.

Written by the driver with torch.utils.tensorboard's SummaryWriter (it needs the
``tensorboard`` package), from the driver's events: ``elastic/world_size`` and
``elastic/round`` at each round, ``elastic/pause_seconds`` at each measured pause,
and every number rank 0 hands ``elastic.report_progress`` as ``progress/NAME``
(``progress/steps_per_second`` from its step rate). The x axis is the training step
rank 0 last reported, so membership changes line up with the loss curve.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elastic.exceptions import ElasticError

FLUSH_S = 5


class TensorBoardError(ElasticError):
    """The writer cannot be made; str() is the one line the user sees."""


class ScalarLog:
    """An ``EventLog`` listener that writes scalars."""

    def __init__(self, directory: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TensorBoardError("--tensorboard needs the tensorboard package "
                                   "(pip install tensorboard)") from None
        try:
            self._writer: SummaryWriter | None = SummaryWriter(log_dir=directory,
                                                               flush_secs=FLUSH_S)
        except OSError as exc:
            raise TensorBoardError(f"--tensorboard {directory!r}: {exc.strerror}") from None
        self.directory = directory
        self.step = 0             # the training step rank 0 last reported

    def on_event(self, event: str, fields: Mapping[str, Any]) -> None:
        writer = self._writer
        if writer is None:
            return
        if event == "round_started":
            writer.add_scalar("elastic/world_size", fields.get("size", 0), self.step)
            writer.add_scalar("elastic/round", fields.get("round", 0), self.step)
        elif event == "pause":
            writer.add_scalar("elastic/pause_seconds", float(fields.get("seconds", 0.0)),
                              self.step)
        elif event == "progress":
            step = fields.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                self.step = step
            for name, value in fields.items():
                if name in ("step", "round", "at") or isinstance(value, bool) \
                        or not isinstance(value, (int, float)):
                    continue
                tag = "progress/steps_per_second" if name == "rate" else f"progress/{name}"
                writer.add_scalar(tag, value, self.step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
