"""A worker's place in its round: rank, size, local and cross ranks, host."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from elastic import protocol as control
from elastic.exceptions import ElasticError


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


def in_round(membership: Membership | None) -> Membership:
    """``membership``, read by code that runs only inside a round (an order the run loop
    keeps and the type checker cannot follow); between rounds, a clear error."""
    if membership is None:
        raise ElasticError("this worker is between rounds: it has no membership to use")
    return membership
