"""A worker's place in its round: rank, size, local and cross ranks, host."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from elastic import protocol as control


@dataclass(frozen=True)
class Membership:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    hostname: str = ""

    def env(self) -> dict[str, str]:
        """The ELASTIC_* / HOROVOD_* variables that describe this membership."""
        return control.membership_env(dataclasses.asdict(self), self.hostname)

    def export(self) -> None:
        """Set them in os.environ: they hold the worker's first round, as Horovod's do."""
        os.environ.update(self.env())
