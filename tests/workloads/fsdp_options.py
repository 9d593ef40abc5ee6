"""FSDP2 options under ShardedState, in one process (a world of 1 on gloo): prints JSON.

Unsupported ones (mixed precision, an HSDP 2-D mesh) must raise UnsupportedSharding
with one line; reshard_after_forward=False must commit and sync back to the commit.
"""

import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import elastic
from elastic.state.fsdp_parts import UnsupportedSharding


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def builder(**options):
    def build(mesh):
        model = net()
        if options.pop("hsdp", False):
            mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)
    return build


def step(state):
    state.optimizer.zero_grad()
    state.model(torch.ones(3, 4)).sum().backward()
    state.optimizer.step()


def refused(**options):
    try:
        elastic.ShardedState(builder(**options)).sync()
    except UnsupportedSharding as exc:
        return str(exc)
    return None


def main():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = {"mixed_precision": refused(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16)),
           "hsdp": refused(hsdp=True)}
    state = elastic.ShardedState(builder(reshard_after_forward=False), step=0)
    state.sync()
    step(state)
    state.step = 1
    state.commit()
    committed = [p.full_tensor().clone() for p in state.model.parameters()]
    moments = [v["exp_avg"].full_tensor().clone() for v in state.optimizer.state.values()]
    step(state)
    state.step = 2
    state.sync()                     # back to the commit, in place
    out["restored"] = all(torch.equal(a, p.full_tensor())
                          for a, p in zip(committed, state.model.parameters())) and all(
        torch.equal(a, v["exp_avg"].full_tensor())
        for a, v in zip(moments, state.optimizer.state.values()))
    out["step"] = state.step
    out["moved"] = state.stats["reshard_received"] + state.stats["reshard_sent"]
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
