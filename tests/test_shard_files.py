"""ShardedState's durable files (elastic/state/shard_files.py) on a real directory:
incremental (unchanged rows are not written again), verified, read back at another
world size, and atomic across a real SIGKILL in the middle of a shard's write."""

import os
import subprocess
import sys

import pytest
import torch
from support.jobs import REPO
from support.shard_commits import full_state, write_commit

from elastic.state import reshard, shard_files


def gathered(root, new_n):
    """The full state read back by ``new_n`` ranks, each reading only what it needs."""
    version, n, folder = shard_files.whole(root)[0]
    out = {}
    for me in range(new_n):
        meta, rest, shards = shard_files.read_for(folder, n, new_n, me)
        pieces = {i: reshard.shard_views(meta, n, i, flats) for i, flats in shards.items()}
        for key, _shape, _d in meta:
            out.setdefault(key, {}).update({i: v for i, views in pieces.items()
                                            for k, v in views.items() if k == key})
    return version, rest, {k: torch.cat([parts[i] for i in sorted(parts)]) for k, parts in
                           out.items()}


KILLED_WRITER = """
import os, signal, sys, torch
sys.path[:0] = [sys.argv[2], os.path.join(sys.argv[2], "tests")]
from support.shard_commits import write_commit, full_state
from elastic.state import shard_files
real = os.replace
def replace(src, dst):          # SIGKILL just before shard 0's manifest would appear
    if dst.endswith("shard0.json") and "v000000000003" in dst:
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)
os.replace = replace
w = shard_files.ShardWriter(sys.argv[1])
write_commit(w, 3, 2, full_state(3))
"""


def test_sharded_checkpoints_are_incremental_verified_and_survive_a_kill_mid_write(tmp_path):
    root = str(tmp_path / "sharded")
    writer = shard_files.ShardWriter(root)
    write_commit(writer, 1, 2, full_state(1))
    first = writer.last["bytes_total"]
    write_commit(writer, 2, 2, full_state(2))
    # Shard 1's frozen rows are the same bytes: hashed, named again, not rewritten.
    assert writer.last["bytes_written"] < writer.last["bytes_total"] == first
    frozen_rows = 20 * 1024 * 4
    assert writer.last["bytes_total"] - writer.last["bytes_written"] == frozen_rows
    version, rest, full = gathered(root, 3)                 # 2 -> 3 shards
    assert version == 2 and rest == b"rest\x02"
    for key, t in full_state(2).items():
        assert full[key].equal(t), key

    # A real SIGKILL of a writer of commit 3 after its blobs, before its manifest.
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, root, str(REPO)],
                          cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert [v for v, _n, _f in shard_files.whole(root)] == [2, 1]       # 3 never appeared
    assert list((tmp_path / "sharded").glob("v*3-n2/*.tmp*"))           # the torn manifest
    version, _rest, full = gathered(root, 1)
    assert version == 2 and full["model/trained"].equal(full_state(2)["model/trained"])

    # Later commits prune: two whole commits, no temp files, only the blobs they name.
    write_commit(writer, 4, 2, full_state(4))
    write_commit(writer, 5, 2, full_state(5))
    assert [v for v, _n, _f in shard_files.whole(root)] == [5, 4]
    folders = sorted(p.name for p in (tmp_path / "sharded").iterdir() if p.name.startswith("v"))
    assert folders == ["v000000000004-n2", "v000000000005-n2"]
    named = set()
    for folder in folders:
        for i in range(2):
            named |= shard_files.manifest_blobs(os.path.join(root, folder, f"shard{i}.json"))
    assert set(os.listdir(os.path.join(root, "blobs"))) == named

    # A corrupt blob is refused, never loaded.
    newest = os.path.join(root, folders[-1])
    victim = sorted(shard_files.manifest_blobs(os.path.join(newest, "shard1.json")))[0]
    path = os.path.join(root, "blobs", victim)
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(data)
    with pytest.raises(shard_files.CorruptShard, match="fails its checksum"):
        shard_files.load_shard(newest, 1)
