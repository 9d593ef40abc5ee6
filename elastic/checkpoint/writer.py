"""Writing one checkpoint (format: format.py) straight from snapshot buffers.

Phase 1 reads the tensors: this thread hashes each one (xxh3-128, format.py)
while an I/O thread writes the previous new blob to a temp file and starts its
writeback, so hashing overlaps the disk; the I/O thread fsyncs them all at the
end, by which time most of the data is on its way (one fsync per blob as it is
written would wait for the disk blob by blob). A tensor whose content already
has a blob is only hashed. Phase 2 makes the checkpoint visible: rename the
blobs, fsync their directory, then write, fsync and rename the manifest, and
fsync the checkpoint directory. A crash at
any point leaves at most temp files and unreferenced blobs, never a manifest
that names a missing or partial file.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from elastic.checkpoint import storage
from elastic.checkpoint.format import (
    ALIGN,
    BLOBS,
    FORMAT,
    SMALL_BYTES,
    blob_path,
    content_name,
    encode_manifest,
    manifest_path,
)

if TYPE_CHECKING:
    from elastic.checkpoint.format import Bytes


def write_checkpoint(directory: str, version: int, skeleton: Any, tensors: Sequence[torch.Tensor],
                     released: Callable[[int | None], None] | None = None,
                     info: dict[str, Any] | None = None, hold_s: float = 0.0,
                     delay_s: float = 0.0) -> dict[str, Any]:
    """Write the checkpoint of commit ``version``; return what it cost.

    ``released(i)`` says that tensor i is no longer read (possibly called from
    the I/O thread), ``released(None)`` that phase 1 is over: from then on the
    caller may overwrite the tensors. ``hold_s``/``delay_s`` are test hooks
    that slow phase 1 / phase 2.
    """
    started = time.perf_counter()
    storage.make_dir(directory)
    storage.make_dir(os.path.join(directory, BLOBS), like=directory)
    mode = storage.file_mode(directory)

    def done(i: int | None) -> None:
        if released is not None and (i is None or i >= 0):
            released(i)

    pending: list[tuple[str, str]] = []     # (temp path, final path) of every file written
    new_blobs: list[str] = []               # names of the blobs this checkpoint writes
    sizes: dict[str, int] = {}
    written = [0]
    io = _IOThread(done, mode)

    def put(name: str, data: Bytes, index: int = -1) -> None:
        if name not in sizes:
            sizes[name] = memoryview(data).nbytes
            if not _has_blob(directory, name, sizes[name]):
                final = blob_path(directory, name)
                pending.append((f"{final}.{os.getpid()}.tmp", final))
                new_blobs.append(name)
                written[0] += sizes[name]
                io.submit(pending[-1][0], data, index)
                return
        done(index)

    try:
        try:
            views = [byte_view(t) for t in tensors]
            pack, offsets = bytearray(), {}
            for i, view in enumerate(views):
                if view.nbytes < SMALL_BYTES:
                    pack.extend(bytes(-len(pack) % ALIGN))
                    offsets[i] = len(pack)
                    pack.extend(view)
                    done(i)
            pack_name = content_name(pack) if offsets else None
            if hold_s:
                time.sleep(hold_s)
            entries = []
            for i, (t, view) in enumerate(zip(tensors, views)):
                if i in offsets:
                    name, offset = pack_name, offsets[i]
                else:
                    name, offset = content_name(view), 0
                    put(name, view, i)
                entries.append({"blob": name, "offset": offset, "nbytes": view.nbytes,
                                "dtype": str(t.dtype).replace("torch.", ""),
                                "shape": list(t.shape)})
            del views
            if pack_name is not None:      # set when there are small tensors (offsets)
                put(pack_name, pack)
            skeleton_bytes = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
            skeleton_name = content_name(skeleton_bytes)
            put(skeleton_name, skeleton_bytes)
        finally:
            io.join()                   # the I/O thread may still read a tensor
            done(None)
        io.raise_error()
        released_s = time.perf_counter() - started
        if delay_s:
            time.sleep(delay_s)
        for temp, final in pending:
            os.replace(temp, final)
        if pending:
            _fsync_path(os.path.join(directory, BLOBS))
        for name in new_blobs:          # hashed from the bytes just written: known good
            storage.remember_blob(directory, name, sizes[name])
        body = dict(info or {}, format=FORMAT, version=int(version), created=time.time(),
                    byteorder=sys.byteorder, skeleton=skeleton_name, tensors=entries,
                    blobs=sizes, bytes_written=written[0])
        path = manifest_path(directory, version)
        pending.append((f"{path}.{os.getpid()}.tmp", path))
        _write_file(pending[-1][0], encode_manifest(body), done=None, mode=mode)
        if delay_s:
            time.sleep(delay_s)
        os.replace(pending[-1][0], path)
        _fsync_path(directory)
    except BaseException:
        for temp, _ in pending:
            try:
                os.unlink(temp)
            except OSError:
                pass
        raise
    return {"version": int(version), "path": path, "bytes_written": written[0],
            "bytes_total": sum(e["nbytes"] for e in entries),
            "blobs_written": len(pending) - 1,
            "release_s": released_s, "seconds": time.perf_counter() - started}


class _IOThread:
    """Writes temp files in order on one thread (inline where no thread can start),
    then fsyncs them all when joined."""

    def __init__(self, done: Callable[[int | None], None], mode: int) -> None:
        self._done = done
        self._mode = mode
        self._queue: queue.Queue[tuple[str, Bytes, int] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._unsynced: list[str] = []
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="elastic-checkpoint-io", daemon=True)
        try:
            self._thread.start()
        except RuntimeError:
            self._thread = None

    def submit(self, path: str, data: Bytes, index: int) -> None:
        if self._thread is None:
            self._write(path, data, index)
        else:
            self._queue.put((path, data, index))

    def _write(self, path: str, data: Bytes, index: int) -> None:
        if self._error is not None:
            self._done(index)       # skipped after an error; the tensor is free anyway
            return
        try:
            _write_file(path, data, done=lambda: self._done(index), mode=self._mode,
                        durable=False)
            self._unsynced.append(path)
        except BaseException as exc:  # noqa: BLE001 - re-raised by raise_error()
            self._error = exc

    def _sync_all(self) -> None:
        try:
            for path in self._unsynced:
                if self._error is None:
                    _fsync_path(path)
        except BaseException as exc:  # noqa: BLE001 - re-raised by raise_error()
            self._error = exc

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._sync_all()
                return
            self._write(*item)

    def join(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        else:
            self._sync_all()

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error


def byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (snapshot buffers are contiguous host tensors)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    # numpy's stubs give ndarray __buffer__ only for Python 3.12+; it is a buffer on any.
    return memoryview(t.view(torch.uint8).numpy())  # type: ignore[arg-type]


def _write_file(path: str, data: Bytes, done: Callable[[], None] | None,
                mode: int = storage.FILE_MODE, durable: bool = True) -> None:
    """Write, call ``done()`` (the data is no longer read), then fsync; or, when not
    ``durable``, only start the writeback (the caller fsyncs later)."""
    fd = storage.create_file(path, mode)
    try:
        try:
            view = memoryview(data).cast("B")
            offset = 0
            while offset < len(view):
                offset += os.write(fd, view[offset:offset + (64 << 20)])
        finally:
            if done is not None:
                done()
        if durable:
            os.fsync(fd)
        elif hasattr(os, "posix_fadvise"):
            # Linux starts writing the dirty pages back on DONTNEED, without waiting.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _has_blob(directory: str, name: str, size: int) -> bool:
    """Reuse a blob only when it is known good (storage.py) and still there.

    Any other file of that name is written again: same name, same bytes.
    """
    if not storage.is_known_good(directory, name, size):
        return False
    try:
        return os.stat(blob_path(directory, name)).st_size == size
    except FileNotFoundError:
        storage.forget_blob(directory, name)
        return False
