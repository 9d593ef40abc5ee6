"""An FSDP2 model and its optimizer, cut into sharded rows and a replicated rest.

A parameter ``fully_shard`` made is a DTensor sharded along dim 0 on a 1-D mesh;
the optimizer state shaped like it (AdamW's ``exp_avg``, ``exp_avg_sq``) is too.
Their local shards are what each rank commits and what a reshard moves
(keys ``model/<name>`` and ``optim/<name>/<state>``). Everything else (buffers,
unsharded parameters, scalar optimizer state such as ``step``, param groups) is
the same on every rank and travels pickled. Loading builds the optimizer's state
from DTensors on the *new* mesh, never by a dummy step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
from torch.distributed.tensor import DTensor, Shard

from elastic.exceptions import ElasticError

if TYPE_CHECKING:
    from elastic.state.shard_plan import Meta


class UnsupportedSharding(ElasticError):
    """An FSDP2 layout ShardedState cannot commit (see docs/fsdp.md, "Limits")."""


def _sharded(t: torch.Tensor, where: str) -> TypeGuard[DTensor]:
    if not isinstance(t, DTensor):
        return False
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        raise UnsupportedSharding(
            f"{where}: placements {tuple(t.placements)} on a {t.device_mesh.ndim}-D mesh; "
            "ShardedState supports fully_shard on a 1-D mesh (Shard(0)) only")
    if t.device.type != "cpu" and not torch.cuda.is_available():
        raise UnsupportedSharding(f"{where}: on {t.device}")
    return True


def check_model(model: torch.nn.Module) -> None:
    """One clear error for FSDP2 options that ShardedState does not support yet."""
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        fsdp = state()
        group = getattr(fsdp, "_fsdp_param_group", None)
        if group is None:
            continue
        policy = group.mp_policy
        if policy.param_dtype is not None or policy.reduce_dtype is not None:
            raise UnsupportedSharding("fully_shard(mp_policy=MixedPrecisionPolicy(...)): "
                                      "mixed precision is not supported by ShardedState yet")
        offload = type(group.offload_policy).__name__
        if offload != "OffloadPolicy":
            raise UnsupportedSharding(f"fully_shard(offload_policy={offload}()): CPU offload "
                                      "is not supported by ShardedState yet")


def split_live(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
               ) -> tuple[Meta, dict[str, torch.Tensor], dict[str, Any]]:
    """(meta, sharded, rest): meta [(key, full shape, dtype name)] in a fixed order,
    sharded {key: local shard tensor}, rest (a picklable tree of the replicated part)."""
    meta: Meta = []
    sharded: dict[str, torch.Tensor] = {}
    rest: dict[str, Any] = {"model": {}, "optim": {}, "groups": []}
    names = {}
    for name, p in model.named_parameters():
        names[id(p)] = name
        if _sharded(p, f"parameter {name}"):
            key = f"model/{name}"
            sharded[key] = p.to_local().detach()
            meta.append((key, tuple(p.shape), str(p.dtype)))
        else:
            rest["model"][name] = p.detach().clone()
    for name, b in model.named_buffers():
        rest["model"][name] = b.detach().clone()
    if optimizer is None:
        return meta, sharded, rest
    for group in optimizer.param_groups:
        rest["groups"].append(dict({k: v for k, v in group.items() if k != "params"},
                                   params=[names[id(p)] for p in group["params"]]))
        for p in group["params"]:
            name = names[id(p)]
            for k, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and _sharded(v, f"optimizer state {name}/{k}"):
                    key = f"optim/{name}/{k}"
                    sharded[key] = v.to_local().detach()
                    meta.append((key, tuple(v.shape), str(v.dtype)))
                else:
                    rest["optim"].setdefault(name, {})[k] = \
                        v.detach().clone() if torch.is_tensor(v) else v
    return meta, sharded, rest


def local_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{key: the local shard tensor} of a model's sharded parameters: where a reshard
    may land their rows in place (load_live then copies nothing for them)."""
    return {f"model/{name}": p.to_local().detach() for name, p in model.named_parameters()
            if isinstance(p, DTensor)}


def load_live(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, rest: dict[str, Any],
              shards: Mapping[str, torch.Tensor]) -> None:
    """Load ``shards`` {key: this rank's rows} and ``rest`` into a freshly built
    FSDP2 model and optimizer. Optimizer state tensors are kept as given."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if isinstance(p, DTensor):
                local = p.to_local()
                got = shards[f"model/{name}"]
                if tuple(local.shape) != tuple(got.shape):
                    raise ElasticError(f"{name}: shard of {tuple(got.shape)} for a local "
                                       f"{tuple(local.shape)} (different model?)")
                if got.data_ptr() != local.data_ptr():    # not already received in place
                    local.copy_(got)
            else:
                p.copy_(rest["model"][name])
        for name, b in model.named_buffers():
            b.copy_(rest["model"][name])
    if optimizer is None:
        return
    order = [p for g in optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in params.items()}
    index = {names[id(p)]: i for i, p in enumerate(order)}
    state = {}
    for name, i in index.items():
        # Keys under its prefix exist only for a DTensor parameter (split_live).
        owner = cast(DTensor, params[name])
        entry = dict(rest["optim"].get(name, {}))
        prefix = f"optim/{name}/"
        for key, local in shards.items():
            if key.startswith(prefix):
                entry[key[len(prefix):]] = DTensor.from_local(
                    local, owner.device_mesh, owner.placements, run_check=False,
                    shape=owner.shape, stride=owner.stride())
        if entry:
            state[i] = entry
    groups = [dict(g, params=[index[n] for n in g["params"]]) for g in rest["groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
