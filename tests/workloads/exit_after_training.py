"""Rank 1 fails after the last collective while rank 0 is still finishing."""

import sys
import time

import elastic

elastic.init()
elastic.barrier()
if elastic.rank() == 1:
    sys.exit(4)
time.sleep(3)
