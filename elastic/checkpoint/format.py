"""On-disk format of durable checkpoints: content-addressed blobs plus one manifest each.

    DIR/LOCK, DIR/LOCK.owner        held by the job's single writer (lock.py)
    DIR/ckpt-000000000120.json      the manifest of commit 120; it exists only once complete
    DIR/blobs/<xxh3-128>            raw bytes: one large tensor, a pack of small tensors,
                                    or the pickled skeleton (everything that is not a tensor)

A blob is named by the xxh3-128 hash of its content (32 hex digits; checkpoints of
format 1 used sha256, 64 hex digits, and still load: a name's length says which
hash checks it), so a tensor that did not change
since an earlier checkpoint already has its file and is not written again: the
new manifest just names it. A manifest is JSON, ``{"body": ..., "sha256": ...}``
where the hash covers the body's canonical JSON; the body lists every tensor as
(blob, offset, nbytes, dtype, shape) in the order of the state's snapshot.
Tensor bytes are the tensor's memory as is (``sys.byteorder`` is recorded).

Writes are atomic (writer.py): blobs and manifest go to temp files,
are fsynced, renamed and their directory fsynced; the manifest is renamed last.
This module reads, verifies and prunes. Loading verifies the
manifest hash and every blob's hash and size, and falls back to the previous
manifest when the newest is torn or corrupt. Only content that was read and
does not verify is corrupt, and only that is quarantined (renamed ``*.corrupt``,
never deleted); a read that fails (an OSError) is retried, then that checkpoint
is skipped for this load (storage.py). Pruning keeps the newest K manifests and
deletes only blobs that none of them names.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Union

import torch
import xxhash

from elastic.checkpoint import storage
from elastic.checkpoint.errors import (  # noqa: F401
    CheckpointError,
    CorruptCheckpoint,
    NewerFormat,
    Unreadable,
    Unusable,
)
from elastic.tensor_tree import join

FORMAT = "elastic-checkpoint/2"             # blobs named by xxh3-128
READABLE = (FORMAT, "elastic-checkpoint/1")  # format 1: blobs named by sha256
BLOBS = "blobs"
SMALL_BYTES = 64 * 1024      # tensors below this are packed into one blob per checkpoint
ALIGN = 64
_MANIFEST = re.compile(r"^ckpt-(\d{12})\.json$")
_BLOB_NAME = re.compile(r"^(?:[0-9a-f]{32}|[0-9a-f]{64})$")
Bytes = Union[bytes, bytearray, memoryview]     # what the hashes read
Warn = Callable[[str], None]                    # reports one line (a warning)


def manifest_path(directory: str, version: int) -> str:
    return os.path.join(directory, f"ckpt-{int(version):012d}.json")


def blob_path(directory: str, name: str) -> str:
    return os.path.join(directory, BLOBS, name)


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """[(version, manifest path)] of the visible checkpoints, oldest first."""
    names = storage.listdir(directory)
    found = [(int(m.group(1)), os.path.join(directory, n))
             for n in names for m in [_MANIFEST.match(n)] if m]
    return sorted(found)


def sha256_hex(data: Bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def content_name(data: Bytes) -> str:
    """A blob's name: the xxh3-128 of its bytes. About 15x faster than sha256 here (the
    writer then runs at disk speed) and it releases the GIL; not cryptographic, which
    content addressing of a directory one trusts (see the pickled skeleton) does not need."""
    return xxhash.xxh3_128_hexdigest(data)


def blob_checks(name: str, data: Bytes) -> bool:
    """Whether ``data`` hashes to ``name``: xxh3-128 for 32 hex digits, sha256 for 64."""
    return (content_name(data) if len(name) == 32 else sha256_hex(data)) == name


def encode_manifest(body: dict[str, Any]) -> bytes:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return json.dumps({"body": body, "sha256": sha256_hex(canonical.encode())},
                      sort_keys=True, indent=1).encode()


# -- reading ----------------------------------------------------------------------------------
def read_manifest(path: str) -> dict[str, Any]:
    """The verified body of a manifest; CorruptCheckpoint when what was read does not
    verify, Unreadable when it could not be read (after retries)."""
    raw = storage.read_bytes(path)
    try:
        doc = json.loads(bytes(raw))
        body = doc["body"]
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        ok = sha256_hex(canonical.encode()) == doc["sha256"]
        fmt = body["format"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"torn or invalid manifest ({exc.__class__.__name__})") from None
    if not ok:
        raise CorruptCheckpoint("manifest checksum mismatch")
    if fmt not in READABLE:
        # Intact (its checksum holds), only newer than this elastic: refused, never quarantined.
        raise NewerFormat(f"written in format {fmt!r} by a newer elastic; this one reads "
                          f"{', '.join(READABLE)}")
    if body.get("byteorder") != sys.byteorder:
        raise CheckpointError(f"checkpoint written on a {body.get('byteorder')}-endian machine")
    return body


def _read_blob(directory: str, name: str, size: int) -> bytearray:
    data = storage.read_bytes(blob_path(directory, name))
    if len(data) != size or not blob_checks(name, data):
        storage.forget_blob(directory, name)
        raise CorruptCheckpoint(f"blob {name[:12]}… fails its checksum", [name])
    storage.remember_blob(directory, name, size)     # verified: a writer may reuse it
    return data


def read_checkpoint(directory: str, body: dict[str, Any], bad_blobs: Iterable[str] = ()) -> Any:
    """Read and verify every blob of a manifest body; return the state tree.

    A blob in ``bad_blobs`` (found corrupt earlier in the same load) makes the
    checkpoint corrupt without reading it again.
    """
    sizes = body["blobs"]
    known_bad = sorted(set(sizes) & set(bad_blobs))
    if known_bad:
        raise CorruptCheckpoint(f"names blob {known_bad[0][:12]}…, which fails its checksum")
    raw_skeleton = _read_blob(directory, body["skeleton"], sizes[body["skeleton"]])
    try:
        skeleton = pickle.loads(raw_skeleton)
    except Exception as exc:  # noqa: BLE001 - a renamed class, a missing module, a new library
        raise Unusable(f"its objects do not unpickle here ({exc.__class__.__name__}: "
                       f"{' '.join(str(exc).split())[:200]})") from None
    tensors: list[Any] = [None] * len(body["tensors"])     # every slot is filled below
    by_blob: dict[str, list[int]] = {}
    for i, e in enumerate(body["tensors"]):
        by_blob.setdefault(e["blob"], []).append(i)
    for name, indices in by_blob.items():
        data = _read_blob(directory, name, sizes[name])
        raw = (torch.frombuffer(data, dtype=torch.uint8) if data
               else torch.empty(0, dtype=torch.uint8))
        for i in indices:
            e = body["tensors"][i]
            dtype = getattr(torch, e["dtype"])
            if e["nbytes"] == 0:
                tensors[i] = torch.empty(e["shape"], dtype=dtype)
                continue
            piece = raw[e["offset"]:e["offset"] + e["nbytes"]]
            # Own memory per tensor: equal tensors share a blob, and must not share storage.
            tensors[i] = piece.view(dtype).reshape(e["shape"]).clone()
        del raw, data
    return join(skeleton, tensors)


def load_newest(directory: str, warn: Warn | None = None,
                quarantine: bool = False) -> tuple[int, Any, str] | None:
    """(version, tree, path) of the newest checkpoint that verifies and loads, or None.

    Each newer one that fails is reported through ``warn``. A corrupt one (its
    content does not verify) is quarantined with ``quarantine`` (only the lock
    holder may): its manifest and bad blobs are renamed to ``*.corrupt``, never
    deleted, so that neither a later load nor a later write trusts them. One
    that cannot be read (an OSError, after retries) is only skipped: nothing is
    renamed, and a later load tries it again. An unusable one (a newer format, objects
    that do not unpickle) is reported and skipped, never renamed.
    """
    def skipped(version: int, path: str, exc: Unusable) -> None:
        if warn is not None:
            warn(f"checkpoint {path} cannot be used ({exc}); trying the previous one")
    return next(candidates(directory, warn, quarantine, skipped), None)


def candidates(directory: str, warn: Warn | None = None, quarantine: bool = False,
               unusable: Callable[[int, str, Unusable], None] | None = None,
               ) -> Iterator[tuple[int, Any, str]]:
    """Yield (version, tree, path) of each checkpoint that verifies and unpickles, newest
    first (corrupt and unreadable ones as ``load_newest`` says); an Unusable one is
    handed to ``unusable(version, path, exc)`` and skipped."""
    bad: set[str] = set()
    for version, path in reversed(list_checkpoints(directory)):
        try:
            tree = read_checkpoint(directory, read_manifest(path), bad)
        except Unusable as exc:
            if unusable is not None:
                unusable(version, path, exc)
            continue
        except CorruptCheckpoint as exc:
            bad.update(exc.bad_blobs)
            if warn is not None:
                warn(f"checkpoint {path} is corrupt ({exc}); "
                     + ("quarantined as *.corrupt; " if quarantine else "")
                     + "trying the previous one")
            if quarantine:
                for name in exc.bad_blobs:
                    storage.forget_blob(directory, name)
                    _rename_quietly(blob_path(directory, name))
                _rename_quietly(path)
            continue
        except CheckpointError as exc:      # Unreadable, or written on another machine
            if warn is not None:
                warn(f"checkpoint {path} cannot be used now ({exc}); skipped for this load, "
                     "nothing renamed; trying the previous one")
            continue
        yield version, tree, path


def _rename_quietly(path: str) -> None:
    """Quarantine ``path`` as ``path.corrupt`` (kept for an operator to look at)."""
    try:
        os.replace(path, path + ".corrupt")
    except OSError:
        pass


# -- housekeeping -----------------------------------------------------------------------------
def remove_temps(directory: str) -> None:
    """Delete the temp files of writes that died (only the lock holder may call this)."""
    for folder in (directory, os.path.join(directory, BLOBS)):
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            continue
        for name in names:
            if name.endswith(".tmp"):
                try:
                    os.unlink(os.path.join(folder, name))
                except OSError:
                    pass


def prune(directory: str, keep: int) -> int:
    """Keep the newest ``keep`` manifests; delete blobs that none of them names.

    Returns the number of blobs deleted. If a kept manifest cannot be read, no
    blob is deleted: its references are unknown. Quarantined files stay.
    """
    checkpoints = list_checkpoints(directory)
    kept = checkpoints[-keep:] if keep > 0 else []
    for _version, path in checkpoints[:len(checkpoints) - len(kept)]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    referenced = set()
    for _version, path in kept:
        try:
            referenced.update(read_manifest(path)["blobs"])
        except CheckpointError:
            return 0
    deleted = 0
    folder = os.path.join(directory, BLOBS)
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        # Only plain blob names: temp files and quarantined ``*.corrupt`` files are never
        # pruned (an operator cleans those up, see the README).
        if _BLOB_NAME.match(name) and name not in referenced:
            storage.forget_blob(directory, name)
            os.unlink(os.path.join(folder, name))
            deleted += 1
    return deleted
