"""Convert a sharded checkpoint (shard_files.py) to torch.distributed.checkpoint (DCP).

    python -m elastic.state.dcp_export CHECKPOINT_DIR OUT_DIR

Our shard files are content-addressed blobs of flat per-dtype rows, which DCP cannot
read. This writes the newest whole commit (or the commit folder given) as a DCP
checkpoint of ``{"model": ..., "optim": ...}`` in the layout of
``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)``
(parameters and optimizer state keyed by parameter name), so any DCP reader, at any
world size and sharding, loads it:

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=OUT_DIR)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

One process, holding the full state in host memory while it writes. The committed
objects (samplers, counters) are not part of it.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from elastic.exceptions import ElasticError
from elastic.state import shard_files, shard_plan


class ExportError(ElasticError):
    """The checkpoint cannot be exported (no whole commit, unreadable files)."""


def full_state(folder: str, n: int) -> dict[str, Any]:
    """{"model": {name: tensor}, "optim": {"state": ..., "param_groups": ...}} of the
    commit in ``folder`` (``n`` shard files), the shards concatenated back."""
    files = [shard_files.load_shard(folder, i) for i in range(n)]
    meta, pickled, _flats = files[0]
    if pickled is None:
        raise ExportError(f"{folder}: shard 0 names no replicated part")
    parts = torch.load(io.BytesIO(pickled), weights_only=False)["parts"]
    full = {}
    for key, shape, _dtype in meta:
        pieces = []
        for i, f in enumerate(files):
            layout, _sizes = shard_plan.shard_layout(meta, n, i)
            d, offset, start, stop = layout[key]
            numel = (stop - start) * shard_plan.row_numel(shape)
            pieces.append(f[2][d][offset: offset + numel].view(
                (stop - start,) + tuple(shape[1:])))
        full[key] = torch.cat(pieces).clone()
    model = dict(parts["model"])
    optim = {name: dict(entry) for name, entry in parts["optim"].items()}
    for key, tensor in full.items():
        kind, _, rest = key.partition("/")
        if kind == "model":
            model[rest] = tensor
        else:
            name, _, state = rest.rpartition("/")
            optim.setdefault(name, {})[state] = tensor
    return {"model": model, "optim": {"state": optim, "param_groups": parts["groups"]}}


def export(source: str, out: str) -> tuple[int, int]:
    """Write the newest whole commit under ``source`` (or the commit folder ``source``)
    to ``out`` as a DCP checkpoint. Returns (version, n)."""
    import torch.distributed.checkpoint as dcp
    found = shard_files.whole(source)
    if not found:
        head, name = os.path.split(os.path.normpath(source))
        found = [c for c in shard_files.whole(head) if os.path.basename(c[2]) == name]
    if not found:
        raise ExportError(f"{source}: no whole sharded commit there (a folder "
                          "v<version>-n<world> with every shard<i>.json)")
    version, n, folder = found[0]
    try:
        state = full_state(folder, n)
    except Exception as exc:  # noqa: BLE001 - reported as one line by main()
        raise ExportError(f"{folder}: cannot read its shard files ({exc})") from exc
    with warnings.catch_warnings():       # "torch.distributed is ... uninitialized": meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=out, no_dist=True)
    return version, n


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m elastic.state.dcp_export",
        description="Write a ShardedState checkpoint as a torch.distributed.checkpoint one.")
    parser.add_argument("source", help="ShardedState's checkpoint_dir, or one commit folder")
    parser.add_argument("out", help="the DCP checkpoint directory to write")
    args = parser.parse_args(argv)
    try:
        version, n = export(args.source, args.out)
    except ExportError as exc:
        sys.stderr.write(f"dcp_export: error: {exc}\n")
        return 1
    print(f"wrote commit {version} ({n} shards) of {args.source} to {args.out} (DCP)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
