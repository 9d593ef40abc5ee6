"""An elasticrun FSDP2 job for the sharded-checkpoint bytes row (fsdp_ckpt_bench.py).

DEPTH x Linear(WIDTH, WIDTH) sharded with fully_shard, AdamW, elastic.ShardedState
with a checkpoint_dir (elasticrun --checkpoint-dir): every commit is also written
to disk, each rank its own shard. The first ``frozen`` layers have requires_grad
False, so their shards never change and AdamW keeps no state for them.

After each commit rank 0 waits until every rank's manifest of that commit is on
disk, then counts what landed in the directory since the previous one: blob files
that are new (by name and inode: a rewrite of the same name counts too) and the
commit's manifests. Nothing of ShardedState's own counters is read.

argv: steps=N commit_every=K frozen=F
Writes $BENCH_OUT/ckpt.json (rank 0): per commit, the bytes landed and the commit's
total (the bytes its manifests name).
"""

import json
import os
import sys
import time

import torch

import elastic
from elastic.state import shard_files

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_bench  # noqa: E402

ARGS = dict(a.split("=", 1) for a in sys.argv[1:])
STEPS = int(ARGS.get("steps", "16"))
COMMIT_EVERY = int(ARGS.get("commit_every", "4"))
FROZEN = int(ARGS.get("frozen", "0"))
WIDTH, DEPTH, BATCH = 1024, 4, 16
WAIT_S = 120


def build(mesh):
    return fsdp_bench.build(mesh, WIDTH, frozen=FROZEN)


def blob_files(root):
    """{(name, inode): size} of the blob files now in ``root`` (a writer's pruning may
    remove old ones meanwhile: never those the newest commit names)."""
    out = {}
    with os.scandir(os.path.join(root, shard_files.BLOBS)) as it:
        for e in it:
            try:
                if ".tmp" not in e.name:
                    out[(e.name, e.inode())] = e.stat().st_size
            except FileNotFoundError:
                pass
    return out


def landed(root, version, n, before):
    """(bytes of new blob files + the commit's manifests, bytes the manifests name,
    blob files now) once every manifest of commit ``version`` exists."""
    folder = os.path.join(root, f"v{version:012d}-n{n}")
    paths = [os.path.join(folder, f"shard{i}.json") for i in range(n)]
    deadline = time.monotonic() + WAIT_S
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise RuntimeError(f"commit {version}'s manifests never all appeared in {folder}")
        time.sleep(0.01)
    now = blob_files(root)
    new = sum(size for key, size in now.items() if key not in before)
    manifests = sum(os.path.getsize(p) for p in paths)
    sizes = {name: size for (name, _ino), size in now.items()}
    named = set().union(*(shard_files.manifest_blobs(p) for p in paths))
    return new + manifests, sum(sizes[b] for b in named) + manifests, now


def main():
    elastic.init()
    state = elastic.ShardedState(build, step=0)
    root = state.checkpoint_dir
    assert root, "run under elasticrun --checkpoint-dir"
    g = torch.Generator().manual_seed(int(os.environ.get("ELASTIC_RANK", "0")))
    x = torch.randn(BATCH, WIDTH, generator=g)
    commits = []

    @elastic.run
    def train(state):
        before = {}
        while state.step < STEPS:
            state.optimizer.zero_grad()
            state.model(x).square().mean().backward()
            state.optimizer.step()
            state.step += 1
            if state.step % COMMIT_EVERY:
                continue
            state.commit()
            if elastic.rank() == 0:
                gen = state.generations[-1]      # the commit just made
                wrote, total, before = landed(root, gen.version, gen.n, before)
                commits.append({"step": state.step, "written": wrote, "total": total})

    train(state)
    if elastic.rank() == 0:
        trainable = sum(p.numel() * p.element_size() for p in state.model.parameters()
                        if p.requires_grad)
        params = sum(p.numel() * p.element_size() for p in state.model.parameters())
        with open(os.path.join(os.environ["BENCH_OUT"], "ckpt.json"), "w") as f:
            json.dump({"commits": commits, "params_bytes": params,
                       "trainable_bytes": trainable, "frozen": FROZEN, "depth": DEPTH,
                       "size": elastic.size()}, f)


if __name__ == "__main__":
    main()
