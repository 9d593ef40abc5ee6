"""Prints its own arguments, then rank 1 raises (an uncaught exception); rank 0 waits
until the driver stops it."""

import sys
import time

import elastic


def load_batch(rank):
    raise ValueError(f"boom on rank {rank}")


elastic.init()
rank = elastic.rank()
print(f"argv={sys.argv[1:]} rank {rank}", flush=True)
if rank == 1:
    load_batch(rank)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(0.1)
