"""Every collective of the API on a real 2-rank gloo group; prints one JSON line."""

import json
import os
import sys

import torch

import elastic

elastic.init()
rank, size = elastic.rank(), elastic.size()
out = {"rank": rank, "size": size}
out["allreduce_avg"] = elastic.allreduce(torch.tensor([float(rank + 1)])).tolist()
out["allreduce_sum"] = elastic.allreduce(torch.tensor([rank + 1]), op=elastic.Sum).tolist()
out["allgather"] = elastic.allgather(torch.arange(rank + 1)).tolist()    # uneven first dims
out["broadcast"] = elastic.broadcast(torch.tensor([rank * 10.0]), root_rank=1).tolist()
out["broadcast_object"] = elastic.broadcast_object({"from": rank}, root_rank=1)
out["allgather_object"] = elastic.allgather_object(f"r{rank}")
elastic.barrier()

torch.manual_seed(rank)                       # different weights on each rank
model = torch.nn.Linear(3, 2)
opt = torch.optim.Adam(model.parameters(), lr=0.1)
if rank == 0:                                 # only rank 0 has optimizer state
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
elastic.broadcast_parameters(model.state_dict(), root_rank=0)
elastic.broadcast_optimizer_state(opt, root_rank=0)
out["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
out["opt_state"] = sorted(len(s) for s in opt.state.values())

# A peer that goes away surfaces as WorkersDepartedError, never a raw backend error.
if rank == 1:
    print(json.dumps(out), flush=True)
    os._exit(0)
try:
    for _ in range(50):
        elastic.allreduce(torch.ones(1000))
    out["departed"] = "no error"
except elastic.WorkersDepartedError:
    out["departed"] = "WorkersDepartedError"
except Exception as exc:  # noqa: BLE001 - reported to the test
    out["departed"] = type(exc).__name__
print(json.dumps(out), flush=True)
sys.stdout.flush()
os._exit(0)
