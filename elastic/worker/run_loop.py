"""The @elastic.run decorator: the loop that survives membership changes."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, TypeVar

from elastic.exceptions import HostsUpdatedInterrupt, StopTraining, WorkersDepartedError
from elastic.worker import error_file, logs, round_view, runtime, torch_world

log = logging.getLogger(__name__)
logs.install()
error_file.install()        # an uncaught exception leaves an error file for the driver


T = TypeVar("T")


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Wrap ``func(state, ...)`` so it resumes after failures and new rounds.

    WorkersDepartedError (or a torch.distributed error, torch_world.explains): restore
    the last commit, then rejoin.
    HostsUpdatedInterrupt: every rank is at the same commit; rejoin without restore.
    A failure while rejoining or syncing is handled the same way, so it never
    kills the worker or blacklists its host.
    """

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> T:
        worker = runtime.ensure_joined()     # the entry point: connects, joins a round
        use_round = getattr(state, "use_round", None)
        if use_round is not None:
            use_round(round_view.current())  # the state's explicit view of this worker's rounds
        rejoin = False
        paused_at = None
        while True:
            try:
                if rejoin:
                    if worker is not None:
                        worker.join_next_round()
                    state.on_reset()
                rejoin = True
                state.sync()
                if paused_at is not None and worker is not None:
                    worker.report_pause(time.monotonic() - paused_at)
                paused_at = None
                result = func(state, *args, **kwargs)
            except StopTraining as exc:
                log.info("%s", exc)      # a SystemExit(0): the script ends here
                raise
            except HostsUpdatedInterrupt:
                paused_at = paused_at or time.monotonic()
                continue
            except Exception as exc:
                # torch.distributed's own errors (user collectives, DDP's backward) too.
                if not isinstance(exc, WorkersDepartedError) and \
                        not torch_world.explains(exc, worker):
                    raise
                paused_at = paused_at or time.monotonic()
                log.info("round %d failed (%s); restoring the last commit",
                         worker.round_id if worker else 0, exc)
                if worker is not None:
                    worker.report_failure(exc)
                state.restore()
                continue
            if worker is not None:
                worker.report_done()
            return result

    return wrapper
