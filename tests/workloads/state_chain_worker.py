"""Four-rank worker for tests/test_state.py: several receivers, striped senders.

Chunks are made tiny (CHUNK_BYTES) so that a small model spans many chunks and
every rank sees chunks from several senders. Writes $STATE_OUT/rank<r>.json.
Phases:
  initial   different seeds everywhere, version -1: rank 0's state reaches 1, 2, 3
            through one chain
  striped   after joint steps + commits, ranks 2 and 3 start over; ranks 0 and 1
            hold the commit unchanged and each send a share; 2 forwards to 3
  changed   a reset-callback-like in-place change on every holder after the commit:
            the root must send its live state (packed), not the stale snapshot
"""

import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from state_sync_worker import build, delta, summary, train_step  # noqa: E402

import elastic  # noqa: E402
from elastic.state import transfer  # noqa: E402

OUT = os.environ["STATE_OUT"]


def main():
    transfer.CHUNK_BYTES = 256
    elastic.init()
    rank = elastic.rank()
    out = {"rank": rank, "size": elastic.size()}

    state = build(seed=100 + rank)
    before = dict(state.sync_stats)
    state.sync()
    out["initial"] = summary(state)
    out["initial_delta"] = delta(before, state.sync_stats)

    for step in range(2):
        train_step(state, step)
        state.commit()
    out["trained"] = summary(state)
    if rank >= 2:
        state = build(seed=700 + rank)
    before = dict(state.sync_stats)
    state.sync()
    out["striped"] = summary(state)
    out["striped_delta"] = delta(before, state.sync_stats)
    train_step(state, 2)
    state.commit()
    out["striped_next"] = summary(state)

    if rank >= 2:
        state = build(seed=900 + rank)
    else:
        with torch.no_grad():
            next(state.model.parameters()).mul_(0.5)   # after the commit, on both holders
    before = dict(state.sync_stats)
    state.sync()
    out["changed"] = summary(state)
    out["changed_delta"] = delta(before, state.sync_stats)

    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)
