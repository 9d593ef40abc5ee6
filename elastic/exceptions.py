"""The root of every error elastic raises, and the exceptions that steer the run loop.

WorkersDepartedError and HostsUpdatedInterrupt mirror Horovod's so that ported
scripts keep their ``except`` clauses. Other errors live next to the code that
raises them and derive from ElasticError too: ControlError (protocol.py),
CheckpointError and its kinds (checkpoint/), LaunchError (launching/client.py),
and the driver's DiscoveryError, UsageError, JobFailed and Interrupted
(runner/). tests/test_structure.py checks that none is left outside the tree.
"""


class ElasticError(RuntimeError):
    """Base class for every error raised by elastic itself."""


class WorkersDepartedError(ElasticError):
    """A peer failed, hung or was evicted; the current round is unusable.

    The run loop answers it by restoring the last commit and joining the next
    round. Every torch.distributed failure inside the framework becomes this.
    """


class HostsUpdatedInterrupt(ElasticError):
    """A new round is pending; raised on every rank at the same commit.

    Nothing failed, so the run loop joins the next round without a restore.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class StopTraining(SystemExit):
    """Raised on every rank at the same commit when elasticrun is stopping (SIGTERM or
    SIGINT to it), and on a worker that got SIGTERM itself once it reaches a commit.

    A SystemExit with code 0: it unwinds the training script (its ``finally``
    blocks run, the code after ``train(state)`` does not) and the checkpointer's
    exit hook writes the last commit on rank 0.
    """

    def __init__(self, why: str) -> None:
        super().__init__(0)
        self.why = why

    def __str__(self) -> str:
        return self.why
