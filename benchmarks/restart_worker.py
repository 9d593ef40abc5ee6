"""Restart-based recovery, the way torchrun recovers: one fresh worker process.

Does what a restarted torchrun worker must do before it trains again: import
torch, rendezvous (init_process_group over a fresh TCPStore), rebuild the
model and optimizer, load the last torch.save checkpoint, and run one step.
Writes $BENCH_OUT/restart.<rank>.json with wall-clock stamps. torchrun's agent
and rendezvous handler would add to this, so the baseline errs in its favour.
"""

import json
import os
import time

T_START = time.time()

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

T_IMPORTED = time.time()


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=timedelta(seconds=60), use_libuv=True)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    t_rdzv = time.time()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt = torch.load(os.environ["BENCH_CKPT"])
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    ddp = DDP(model)
    t_loaded = time.time()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    optimizer.zero_grad()
    F.cross_entropy(ddp(x), y).backward()
    optimizer.step()
    time.sleep(float(os.environ.get("BENCH_STEP_SLEEP", "0.01")))
    t_step = time.time()
    with open(os.path.join(os.environ["BENCH_OUT"], f"restart.{rank}.json"), "w") as f:
        json.dump({"t_start": T_START, "t_imported": T_IMPORTED, "t_rdzv": t_rdzv,
                   "t_loaded": t_loaded, "t_step": t_step}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
