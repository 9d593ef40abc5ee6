"""Commits of a small sharded state written with shard_files.ShardWriter, as each rank of
a ShardedState would write its shard: shared by tests/test_shard_files.py and the writer
it SIGKILLs in a subprocess."""

import torch

from elastic.state import reshard

META = [("model/frozen", (40, 1024), "torch.float32"),      # 80 KiB a row block: own blobs
        ("model/trained", (40, 1024), "torch.float32"),
        ("model/bias", (40,), "torch.float32")]              # small: packed


def full_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"model/frozen": torch.ones(40, 1024),                        # never changes
            "model/trained": torch.randn(40, 1024, generator=g),
            "model/bias": torch.randn(40, generator=g)}


def write_commit(writer, version, n, full, rest=b"rest"):
    for i in range(n):
        flats = reshard.empty_shard(META, n, i)
        views = reshard.shard_views(META, n, i, flats)
        for key, view in views.items():
            start = sum(reshard.shard_views(META, n, j, reshard.empty_shard(META, n, j))[key]
                        .shape[0] for j in range(i))
            view.copy_(full[key][start: start + view.shape[0]])
        writer.write(version, n, i, META, flats, rest + bytes([version]))
        writer.wait()
