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

The driver starts it at ``SCHED_IDLE`` where it can undo that, and puts it back to
``SCHED_OTHER`` before it sends the spec (runner/spares.py): its imports take only CPU
the training leaves idle.

Importing is all the spare does before it becomes a worker. elastic's modules read the
environment when they are called, never at import (tests/test_warm_spare.py checks it), so
importing them early changes nothing the worker sees.
"""

import json
import os
import runpy
import sys

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
    preload()
    line = sys.stdin.readline()
    if not line.strip():
        return 0                                   # dropped before it was needed
    become(json.loads(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
