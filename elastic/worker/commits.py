"""The commit's collective check: what every rank learns, at the same commit.

At every commit each rank brings what it knows (only rank 0 looks at the store:
a newer round, elasticrun's stop; every rank: whether it was asked to leave) and
one tiny Max allreduce hands every rank the same answer, so every rank raises at
the same commit (docs/architecture.md, "A round's life", step 6). The worker
owns this check (``Worker.check_commit``); a State only asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from elastic.worker import waiting

if TYPE_CHECKING:
    from elastic.worker.groups import TrackedGroup
    from elastic.worker.waiting import RoundWaits


@dataclass(frozen=True)
class CommitCheck:
    """One rank's flags at a commit, or (after the collective) every rank's Max of them.

    ``pending_round``: a round newer than ours that rank 0 saw (0: none), so every
    rank joins it without reading the store again. ``leaving``: a rank was asked to
    leave (SIGTERM to it) and leaves at this commit; the others re-form without it.
    ``stopping``: elasticrun is stopping, and every rank stops at this commit."""

    pending_round: int = 0
    leaving: bool = False
    stopping: bool = False

    @property
    def reforms(self) -> bool:
        """Whether the round changes at this commit (every rank raises HostsUpdatedInterrupt)."""
        return bool(self.pending_round or self.leaving)

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([self.pending_round, int(self.leaving), int(self.stopping)],
                            dtype=torch.int32)

    @classmethod
    def from_tensor(cls, flags: torch.Tensor) -> CommitCheck:
        pending, leaving, stopping = (int(x) for x in flags.tolist())
        return cls(pending_round=pending, leaving=bool(leaving), stopping=bool(stopping))


def agree(mine: CommitCheck, group: TrackedGroup, waits: RoundWaits) -> CommitCheck:
    """Every rank's Max of ``mine`` over the round's CPU ``group``, waited on in slices
    that watch the round's abort (a failure raises WorkersDepartedError)."""
    flags = mine.to_tensor()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
    work = waiting.issue(lambda: group.allreduce([flags], opts), "allreduce")
    waits.progress.issue()
    waiting.wait(work, "allreduce", waits)
    return CommitCheck.from_tensor(flags)
