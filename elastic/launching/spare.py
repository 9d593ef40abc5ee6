"""A warm spare: a Python process that imports torch before it is needed, then becomes a
worker (``elasticrun --warm-spare``).

A replacement started after a crash spends seconds importing torch, and on a loaded
host far more, while its peers train without it or wait for it. The driver keeps one
spare per local host: ``python -m elastic.launching.spare``, started with a worker's
environment once every worker it started is ready. The spare imports the heavy modules,
then blocks on one line of stdin. When the driver needs a worker there it writes the
worker's spec (its environment and ``[script, args...]``) as JSON; the spare takes that
environment as its own and runs the script as ``__main__``, as ``python script args``
would. It is the same process from then on: the driver's handle, exit code, signals and
output pipes are those of an ordinary worker. End of input (the driver dropped it, or
died) ends the spare quietly.

Its imports would take CPU from the workers training beside it, so where the process
may come back to normal priority (root, or ``RLIMIT_NICE`` ≥ 20: sched(7)) the spare
waits at ``SCHED_IDLE``: it gets only CPU nothing else wants. A thread watching stdin
puts every thread back to ``SCHED_OTHER`` the moment the spec arrives, before the
worker runs; elsewhere the spare imports at normal priority.

Importing is all the spare does before it becomes a worker. elastic's modules read the
environment when they are called, never at import (tests/test_warm_spare.py checks it), so
importing them early changes nothing the worker sees.
"""

import json
import os
import runpy
import select
import sys
import threading

# Imported ahead of need; each is what a replacement would otherwise import after the
# crash (torch._dynamo: the optimizer's first step pulls it in).
PRELOAD = ("torch", "torch.distributed", "torch.nn", "torch.optim", "torch._dynamo", "elastic",
           "elastic.torch")


def preload(names: tuple[str, ...] = PRELOAD) -> None:
    import importlib
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the worker imports it again and sees the error
            pass


def may_return_from_idle() -> bool:
    """Whether this process may leave SCHED_IDLE again (an unprivileged one needs
    RLIMIT_NICE >= 20 to return to SCHED_OTHER at nice 0)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    if os.geteuid() == 0:
        return True
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return soft == resource.RLIM_INFINITY or soft >= 20


def normal_priority() -> None:
    """Every thread of this process back to SCHED_OTHER."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass                 # a thread that just ended


def idle_until_needed(stdin_fd: int = 0) -> bool:
    """Run at SCHED_IDLE until ``stdin_fd`` is readable (the spec, or the end of input),
    then at normal priority; False, changing nothing, where that could not be undone."""
    if not may_return_from_idle():
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        return False

    def watch() -> None:
        select.select([stdin_fd], [], [])
        normal_priority()

    threading.Thread(target=watch, daemon=True, name="elastic-spare-wake").start()
    return True


def become(spec: dict) -> None:
    """Take the worker's environment and argv, then run its script as ``__main__``."""
    argv = [str(a) for a in spec["argv"]]
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in spec["env"].items()})
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    devnull = os.open(os.devnull, os.O_RDONLY)     # a worker's stdin is /dev/null
    os.dup2(devnull, 0)
    os.close(devnull)
    runpy.run_path(argv[0], run_name="__main__")


def main() -> int:
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)          # run by path: this folder's modules must not shadow others
    idle = idle_until_needed()
    preload()
    line = sys.stdin.readline()
    if not line.strip():
        return 0                                   # dropped before it was needed
    if idle:
        normal_priority()       # the watcher does it too; the worker must not start idle
    become(json.loads(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
