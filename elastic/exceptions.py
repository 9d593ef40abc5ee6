"""Exceptions that steer the elastic run loop.

They mirror Horovod's so that ported scripts keep their ``except`` clauses.
"""


class ElasticError(RuntimeError):
    """Base class for errors raised by elastic itself."""


class WorkersDepartedError(ElasticError):
    """A peer failed, hung or was evicted; the current round is unusable.

    The run loop answers it by restoring the last commit and joining the next
    round. Every torch.distributed failure inside the framework becomes this.
    """


class HostsUpdatedInterrupt(ElasticError):
    """A new round is pending; raised on every rank at the same commit.

    Nothing failed, so the run loop joins the next round without a restore.
    """

    def __init__(self, skip_sync=False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class FencedError(ElasticError):
    """This worker belongs to a round that is over; it must not take part."""
