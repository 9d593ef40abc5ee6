"""An error of the job, not of the host it shows up on: the job stops with one line.

An unusable checkpoint (another model, a class that no longer unpickles) fails the
same way on whichever host loads it; exiting with an ordinary failure would blacklist
host after host. So the worker puts the line in its sealed ``Keys.fatal`` key, prints
it, and exits with ``protocol.EXIT_STOP_JOB``: the driver stops the job with that line
and blames no host (policy.handle_exits).
"""

import sys
from typing import NoReturn

from elastic import protocol
from elastic.worker import runtime


def stop_job(line: str) -> NoReturn:
    """Stop the whole job with ``line`` (never returns)."""
    w = runtime.worker()
    if w is not None:
        try:
            w.control.put(protocol.Keys.fatal(w.worker_id), {"line": line})
        except Exception:  # noqa: BLE001 - the exit code and the line still tell
            pass
    sys.stderr.write(f"elastic: error: {line}\n")
    sys.stderr.flush()
    sys.exit(protocol.EXIT_STOP_JOB)
