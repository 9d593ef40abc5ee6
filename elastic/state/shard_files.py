"""Durable copies of a sharded commit: each rank writes its own shard, off the training
thread, incrementally and atomically.

Layout::

    DIR/blobs/<xxh3-128>              raw bytes: one tensor's rows of one shard, a pack of
                                      the shard's small tensors, or the pickled rest
    DIR/v<version>-n<world>/shard<i>.json   shard i's manifest: per tensor (blob, offset,
                                      bytes); shard 0's also names the rest

Blobs are named by the hash of their content, as elastic.Checkpointer's are, so rows
that did not change since the last commit (a frozen layer, an untouched embedding)
are only hashed: the new manifest names the existing file. Every file goes to a
temporary name, is fsynced and renamed; a shard's manifest goes last, so a commit is
whole once all ``n`` manifests exist and no rank waits on another. Reading checks
each manifest's sha256 and each blob's hash and size. A rerun at any world size
reads only the shards whose rows it needs (shard_plan.rows). Pruning runs under an
exclusive ``flock`` on ``DIR/.lock`` that every writer holds shared while it writes,
so a blob is never deleted between a writer's choosing to reuse it and its manifest
naming it. Folders of format 1 (``shard<i>.pt``, torch.save archives) still load.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import sys
import threading
from typing import TYPE_CHECKING, Any

import torch

from elastic.checkpoint import format as ckpt_format
from elastic.exceptions import ElasticError
from elastic.state import reshard, shard_plan

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from elastic.state.shard_plan import Meta

_DIR = re.compile(r"^v(\d+)-n(\d+)$")
KEEP = 2        # whole commits kept on disk
FORMAT = "elastic-shards/2"
BLOBS = "blobs"
SMALL_BYTES = ckpt_format.SMALL_BYTES      # tensors below this share one pack per shard


class CorruptShard(ElasticError):
    """A shard manifest or blob that does not verify."""


class ShardWriter:
    """Writes one rank's shard of each commit in a background thread (one at a time:
    a commit while the previous write runs waits for it)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._thread: threading.Thread | None = None
        self._known: dict[str, int] = {}        # blob name -> size, written or verified by this process
        self.written = 0
        self.durable = -1       # the newest commit this rank saw whole on disk
        self.last = {"bytes_written": 0, "bytes_total": 0}
        self._warned = False
        self._new_bytes = 0     # written by the current write

    def write(self, version: int, n: int, index: int, meta: Meta, flats: dict[str, torch.Tensor],
              rest: bytes) -> None:
        """Start writing (the flats are never written to again: each commit's are new)."""
        self.wait()
        self._thread = threading.Thread(
            target=self._run, args=(version, n, index, meta, flats, rest),
            name="elastic-shard-writer")        # not a daemon: the last write finishes
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, version: int, n: int, index: int, meta: Meta,
             flats: dict[str, torch.Tensor], rest: bytes) -> None:
        try:
            self._write(version, n, index, meta, flats, rest)
        except OSError as exc:      # a full or read-only disk never stops training
            if not self._warned:
                sys.stderr.write(f"elastic: warning: writing the shard checkpoint to "
                                 f"{self.root} failed ({exc}); training goes on and tries "
                                 "again at the next commit\n")
                self._warned = True

    def _write(self, version: int, n: int, index: int, meta: Meta,
               flats: dict[str, torch.Tensor], rest: bytes) -> None:
        folder = os.path.join(self.root, f"v{version:012d}-n{n}")
        os.makedirs(os.path.join(self.root, BLOBS), exist_ok=True)
        os.makedirs(folder, exist_ok=True)
        views = reshard.shard_views(meta, n, index, flats)
        with _locked(self.root, fcntl.LOCK_SH):
            total, entries, small = 0, {}, []
            for key, _shape, _d in meta:
                data = _bytes(views[key])
                if len(data) < SMALL_BYTES:
                    small.append((key, data))
                    continue
                entries[key] = [self._put(data), 0, len(data)]
            if small:
                pack, offsets, offset = bytearray(), {}, 0
                for key, data in small:
                    offsets[key] = (offset, len(data))
                    pack += data
                    offset += len(data)
                name = self._put(pack)
                entries.update({k: [name, o, size] for k, (o, size) in offsets.items()})
            body: dict[str, Any] = {"format": FORMAT, "version": version, "n": n, "index": index,
                    "byteorder": sys.byteorder, "meta": [list(m) for m in meta],
                    "tensors": entries,
                    "rest": [self._put(rest), len(rest)] if index == 0 else None}
            for name in {e[0] for e in entries.values()} | ({body["rest"][0]} if index == 0
                                                             else set()):
                total += self._known[name]
            written = self._new_bytes
            self._new_bytes = 0
            _atomic_write(os.path.join(folder, f"shard{index}.json"),
                          ckpt_format.encode_manifest(body))
            _fsync_dir(folder)
        self.written += 1
        self.last = {"bytes_written": written, "bytes_total": total}
        if all(_has_shard(folder, i) for i in range(n)):
            self.durable = max(self.durable, version)     # whole: this rank saw it so
        prune(self.root)

    def _put(self, data):
        """The blob name for ``data``; written unless this process wrote or verified it."""
        name = ckpt_format.content_name(data)
        path = os.path.join(self.root, BLOBS, name)
        try:
            there = os.stat(path).st_size == len(data) and self._known.get(name) == len(data)
        except FileNotFoundError:
            there = False
        if not there:
            _atomic_write(path, data)
            self._new_bytes += len(data)
            self._known[name] = len(data)
            _fsync_dir(os.path.dirname(path))
        return name


def _bytes(t):
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _atomic_write(path, data):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _locked:
    """flock on ROOT/.lock: shared for writers, exclusive (never waited for) to prune."""

    def __init__(self, root: str, mode: int) -> None:
        self.path, self.mode, self.held = os.path.join(root, ".lock"), mode, False
        self.fd = -1

    def __enter__(self) -> Any:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, self.mode)
            self.held = True
        except OSError:
            self.held = False
        return self

    def __exit__(self, *exc):
        os.close(self.fd)      # releases the lock


def _has_shard(folder, i):
    return os.path.exists(os.path.join(folder, f"shard{i}.json")) or \
        os.path.exists(os.path.join(folder, f"shard{i}.pt"))


def whole(root: str | None) -> list[tuple[int, int, str]]:
    """[(version, n, folder)] of the commits whose every shard manifest exists, newest first."""
    if not root or not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _DIR.match(name)
        if not m:
            continue
        version, n = int(m.group(1)), int(m.group(2))
        folder = os.path.join(root, name)
        if all(_has_shard(folder, i) for i in range(n)):
            out.append((version, n, folder))
    return sorted(out, reverse=True)


def prune(root: str) -> None:
    """Remove the commit folders older than the newest KEEP whole ones, the blobs no
    remaining manifest names and stale temporary files; skipped while a writer writes."""
    with _locked(root, fcntl.LOCK_EX | fcntl.LOCK_NB) as lock:
        if not lock.held:
            return
        kept = whole(root)[:KEEP]
        if len(kept) < KEEP:
            return
        oldest = kept[-1][0]
        named = set()
        for name in os.listdir(root):
            m = _DIR.match(name)
            if not m:
                continue
            folder = os.path.join(root, name)
            if int(m.group(1)) < oldest:
                shutil.rmtree(folder, ignore_errors=True)
                continue
            for f in os.listdir(folder):
                if ".tmp" in f:
                    os.unlink(os.path.join(folder, f))
                elif f.endswith(".json"):
                    try:
                        named |= _names(_manifest(os.path.join(folder, f)))
                    except CorruptShard:
                        pass
        blobs = os.path.join(root, BLOBS)
        for name in os.listdir(blobs) if os.path.isdir(blobs) else ():
            if name not in named and not name.endswith(".corrupt"):
                os.unlink(os.path.join(blobs, name))


def manifest_blobs(path: str) -> set[str]:
    """The blob names the shard manifest at ``path`` uses."""
    return _names(_manifest(path))


def _names(body):
    out = {e[0] for e in body["tensors"].values()}
    return out | ({body["rest"][0]} if body.get("rest") else set())


def _manifest(path):
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        body = doc["body"]
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        ok = ckpt_format.sha256_hex(canonical.encode()) == doc["sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptShard(f"{path}: torn or invalid manifest ({exc.__class__.__name__})") \
            from None
    if not ok:
        raise CorruptShard(f"{path}: manifest checksum mismatch")
    if body.get("format") != FORMAT or body.get("byteorder") != sys.byteorder:
        raise CorruptShard(f"{path}: format {body.get('format')!r} "
                           f"({body.get('byteorder')}-endian) is not {FORMAT!r} here")
    return body


def _blob(root, name, offset, size, cache):
    if name not in cache:
        with open(os.path.join(root, BLOBS, name), "rb") as f:
            data = f.read()
        if not ckpt_format.blob_checks(name, data):
            raise CorruptShard(f"{root}: blob {name[:12]}… fails its checksum")
        cache[name] = data
    data = cache[name]
    if offset + size > len(data):
        raise CorruptShard(f"{root}: blob {name[:12]}… is shorter than its manifest says")
    return data[offset: offset + size]


def load_shard(folder: str, i: int) -> tuple[Meta, bytes | None, dict[str, torch.Tensor]]:
    """(meta, rest or None, {dtype: flat}) of shard ``i`` of the commit in ``folder``,
    verified (CorruptShard when it does not)."""
    legacy = os.path.join(folder, f"shard{i}.pt")
    if not os.path.exists(os.path.join(folder, f"shard{i}.json")) and os.path.exists(legacy):
        f = torch.load(legacy, weights_only=False)
        return [tuple(m) for m in f["meta"]], f["rest"], f["flats"]
    body = _manifest(os.path.join(folder, f"shard{i}.json"))
    root = os.path.dirname(os.path.normpath(folder))
    meta = [(key, tuple(shape), d) for key, shape, d in body["meta"]]
    flats = reshard.empty_shard(meta, body["n"], i)
    views = reshard.shard_views(meta, body["n"], i, flats)
    cache: dict[str, bytes] = {}
    for key, (name, offset, size) in body["tensors"].items():
        dest = _bytes(views[key])
        if len(dest) != size:
            raise CorruptShard(f"{folder}: shard {i}'s {key} has {size} bytes, not {len(dest)}")
        dest[:] = _blob(root, name, offset, size, cache)
    rest = _blob(root, body["rest"][0], 0, body["rest"][1], cache) if body["rest"] else None
    return meta, rest, flats


def read_for(folder: str, n: int, new_n: int, me: int,
             ) -> tuple[Meta, bytes | None, dict[int, dict[str, torch.Tensor]]]:
    """(meta, rest, {old shard index: flats}) for rank ``me`` of ``new_n``: only the
    shard files that hold rows of its new shard (and shard 0's, for meta and rest)."""
    meta, rest, first = load_shard(folder, 0)
    needed = set()
    for _key, shape, _d in meta:
        start, stop = shard_plan.rows(shape[0], new_n, me)
        for i in range(n):
            a, b = shard_plan.rows(shape[0], n, i)
            if max(a, start) < min(b, stop):
                needed.add(i)
    shards = {0: first} if 0 in needed else {}
    for i in sorted(needed - {0}):
        shards[i] = load_shard(folder, i)[2]
    return meta, rest, shards
