"""Worker for tests/test_torch_distributed.py: the last rank stops (SIGSTOP: alive, its
connections open, so gloo never sees it go) and the others then block on it in a
user's dist.all_reduce and in elastic.DDP's backward. The test aborts the round, as
the driver does; each blocked call must raise instead of waiting for the group timeout.
Prints one JSON line per surviving rank."""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

import elastic
from elastic.worker import runtime, torch_world

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ["HUNG_OUT"]


def outcome(fn):
    try:
        fn()
        return "no error"
    except Exception as exc:  # noqa: BLE001 - what the test asserts on
        explained = torch_world.explains(exc, runtime.worker())
        return f"{type(exc).__name__} explained={explained}"


def main():
    elastic.init()
    rank = elastic.rank()
    model = elastic.DDP(torch.nn.Linear(4, 1))
    for _ in range(2):      # DDP built and its buckets rebuilt (a collective) by all
        model(torch.randn(2, 4)).sum().backward()
    if rank == elastic.size() - 1:
        open(os.path.join(OUT, "stopping"), "w").close()
        os.kill(os.getpid(), signal.SIGSTOP)
    open(os.path.join(OUT, f"blocking.{rank}"), "w").close()
    result = {"rank": rank, "all_reduce": outcome(lambda: dist.all_reduce(torch.ones(1))),
              "ddp_backward": outcome(lambda: model(torch.randn(2, 4)).sum().backward())}
    print(json.dumps(result), flush=True)
    os._exit(0)       # the abandoned work still waits on rank 2: no destructor may wait on it


if __name__ == "__main__":
    main()
