"""Durable copies of a sharded commit: each rank writes its own shard, off the training thread.

Layout: ``DIR/v<version>-n<world>/shard<i>.pt``, one file per shard, written to a
temporary name and renamed (a reader never sees half a file). A commit is whole
once all ``n`` files exist, so no rank waits on another to finish. A rerun at any
world size reads only the files whose rows it needs (shard_plan.rows). The files
are torch.save archives of plain tensors, not torch.distributed.checkpoint's format.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from typing import TYPE_CHECKING

import torch

from elastic.state import shard_plan

if TYPE_CHECKING:
    from elastic.state.shard_plan import Meta

_DIR = re.compile(r"^v(\d+)-n(\d+)$")
KEEP = 2        # whole commits kept on disk


class ShardWriter:
    """Writes one rank's shard of each commit in a background thread (one at a time:
    a commit while the previous write runs waits for it)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._thread: threading.Thread | None = None
        self.written = 0
        self.durable = -1       # the newest commit this rank saw whole on disk

    def write(self, version: int, n: int, index: int, meta: Meta, flats: dict[str, torch.Tensor],
              rest: bytes) -> None:
        """Start writing (the flats are never written to again: each commit's are new)."""
        self.wait()
        self._thread = threading.Thread(
            target=self._write, args=(version, n, index, meta, flats, rest),
            name="elastic-shard-writer")        # not a daemon: the last write finishes
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, version, n, index, meta, flats, rest):
        folder = os.path.join(self.root, f"v{version:012d}-n{n}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"shard{index}.pt")
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save({"version": version, "n": n, "index": index, "meta": meta,
                    "flats": flats, "rest": rest}, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.written += 1
        if all(os.path.exists(os.path.join(folder, f"shard{i}.pt")) for i in range(n)):
            self.durable = max(self.durable, version)     # whole: this rank saw it so
        if index == 0:
            prune(self.root)


def whole(root: str | None) -> list[tuple[int, int, str]]:
    """[(version, n, folder)] of the commits whose every shard file exists, newest first."""
    if not root or not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _DIR.match(name)
        if not m:
            continue
        version, n = int(m.group(1)), int(m.group(2))
        folder = os.path.join(root, name)
        if all(os.path.exists(os.path.join(folder, f"shard{i}.pt")) for i in range(n)):
            out.append((version, n, folder))
    return sorted(out, reverse=True)


def prune(root: str) -> None:
    """Remove every commit folder older than the newest KEEP whole ones."""
    kept = whole(root)[:KEEP]
    if len(kept) < KEEP:
        return
    oldest = kept[-1][0]
    for name in os.listdir(root):
        m = _DIR.match(name)
        if m and int(m.group(1)) < oldest:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def read_for(folder: str, n: int, new_n: int,
             me: int) -> tuple[Meta, bytes, dict[int, dict[str, torch.Tensor]]]:
    """(meta, rest, {old shard index: flats}) for rank ``me`` of ``new_n``: only the
    shard files that hold rows of its new shard (and shard 0's, for meta and rest)."""
    first = torch.load(os.path.join(folder, "shard0.pt"), weights_only=False)
    meta = first["meta"]
    needed = set()
    for _key, shape, _d in meta:
        start, stop = shard_plan.rows(shape[0], new_n, me)
        for i in range(n):
            a, b = shard_plan.rows(shape[0], n, i)
            if max(a, start) < min(b, stop):
                needed.add(i)
    shards = {0: first["flats"]} if 0 in needed else {}
    for i in sorted(needed - {0}):
        shards[i] = torch.load(os.path.join(folder, f"shard{i}.pt"), weights_only=False)["flats"]
    return meta, first["rest"], shards
