"""How a worker process ends: with os._exit after Python's own cleanup."""

import atexit
import logging
import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import NoReturn

from elastic.worker.devices import PlacementError


class ExitGuard:
    """Ends a worker process without running C++ destructors.

    Groups from aborted rounds may still hold gloo work blocked on a peer;
    destroying them at interpreter exit can end in std::terminate. So the
    worker leaves with os._exit once Python-level cleanup (atexit handlers
    registered after init, logging, stdio) has run, keeping the exit status.
    """

    def __init__(self, shutdown: Callable[[], None]) -> None:
        self._shutdown = shutdown      # the worker's own cleanup, run first
        self.code = 0
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        self._installed = True
        original_exit, original_hook = sys.exit, sys.excepthook

        def exit_(status: str | int | None = None) -> NoReturn:
            self.code = status if isinstance(status, int) else (0 if status is None else 1)
            original_exit(status)

        def hook(kind: type[BaseException], value: BaseException,
                 tb: TracebackType | None) -> None:
            self.code = 1
            if isinstance(value, PlacementError):
                # A configuration error, the same on every round: one line, no traceback.
                sys.stderr.write(f"elastic: error: {value}\n")
                return
            original_hook(kind, value, tb)

        sys.exit, sys.excepthook = exit_, hook
        atexit.register(self._leave)

    def _leave(self) -> None:
        self._shutdown()
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not change the exit
                pass
        os._exit(self.code)


