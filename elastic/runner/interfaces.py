"""The driver's seams, as ``typing.Protocol`` classes: what it asks of a discovery
source, of a backend that starts workers for it, and of a running worker's handle.

Nothing inherits from these: any class with the methods fits (``ScriptDiscovery``,
``agents.AgentHub``, ``launcher.WorkerProcess``, the simulated cluster of
benchmarks/scale_sim.py). They say at the seam what each method returns and when
it may be called, so a new backend knows what to provide; mypy checks the fit where
JobConfig and the driver use them.
"""

from __future__ import annotations

import signal
from typing import Any, Protocol


class DiscoverySource(Protocol):
    """Where the hosts come from: ``-H``, a discovery script, or the joined agents."""

    def discover(self) -> dict[str, int]:
        """The hosts there are now, with their slots. Called from the driver's discovery
        thread every --discovery-interval; raises discovery.DiscoveryError (one line)
        when the hosts cannot be known this time: the driver keeps the last ones."""
        ...


class WorkerHandle(Protocol):
    """A started worker process, wherever it runs."""

    def poll(self) -> int | None:
        """Its exit code once it exited (negative: the signal), else None. Cheap."""
        ...

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send it ``sig`` (SIGTERM: leave at the next commit); nothing if it exited."""
        ...

    def join_output(self, timeout: float = 2.0) -> None:
        """Wait up to ``timeout`` for the output it wrote before exiting to arrive."""
        ...

    def describe_exit(self, code: int) -> str:
        """More words for an exit with ``code`` (why an ssh link or an agent was lost),
        appended to the exit's line; "" when there is nothing to add."""
        ...


class LauncherBackend(Protocol):
    """Starts workers on the hosts it owns, in place of the driver's own launcher
    (joining mode: agents.AgentHub). The driver starts a worker on any other host
    itself, locally or over ssh (launcher.py)."""

    def attach(self, address: str, port: int, secret: str, sink: Any) -> None:
        """Once, when the driver's store listens at ``address:port``; ``sink`` takes
        the workers' output (console.Console)."""
        ...

    def owns(self, host: str) -> bool:
        """Whether workers on ``host`` are started through this backend."""
        ...

    def start(self, worker_id: str, host: str, env: dict[str, str]) -> WorkerHandle:
        """Start the training command on ``host`` with only ``env`` added (the job's
        variables: the driver's own environment does not travel)."""
        ...

    def take_adopted(self) -> list[tuple[str, str, WorkerHandle | None]]:
        """Workers a restarted driver takes back, each once: (worker id, host, handle);
        a None handle: it ended while the driver was away. [] for a backend that never
        outlives its driver."""
        ...

    def outage_report(self) -> Any:
        """What the hosts that came back said of the time no driver ran (outage.Back);
        an empty Back for a backend that never outlives its driver."""
        ...

    def take_failed_away(self) -> list[tuple[str, str, int]]:
        """(worker id, host, code) of workers that failed while no driver read their
        exit, each once; [] for a backend that never outlives its driver."""
        ...

    def close(self, code: int = 0) -> None:
        """The job is over (``code``: the driver's exit code): let the hosts go."""
        ...
