"""How the checkpoint store touches its directory: retries, permissions, known-good blobs.

* **Transient errors are not corruption.** A read that fails with an OSError
  (NFS: EIO, ESTALE; EMFILE; a file briefly missing) is retried with backoff;
  if it keeps failing, the caller skips that checkpoint for this load and
  renames nothing (``Unreadable``). Only content that was read and does not
  verify is corrupt (format.py).
* **Owner-only files.** A directory the store creates is 0700 and its files
  0600. A directory that already exists keeps its permissions, and new files
  get the group/other read bits it grants (a 0750 directory gets 0640 files),
  so an operator's shared directory stays readable to those it was shared
  with; write bits are never passed on.
* **Known-good blobs.** A blob is reused by a new checkpoint only when this
  process knows its content is good: it wrote it (and recorded its hash), or
  it read it back and verified size and hash. Any other file with the right
  name is written again, which replaces it with the same bytes.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from elastic.checkpoint.errors import Unreadable

RETRY_DELAYS_S = (0.05, 0.2, 0.8)     # then give up on this file for this load
_sleep = time.sleep                   # tests replace it to act between attempts
T = TypeVar("T")
DIR_MODE = 0o700
FILE_MODE = 0o600


def retrying(fn: Callable[[], T], what: str, delays: Sequence[float] = RETRY_DELAYS_S,
             sleep: Callable[[float], None] | None = None) -> T:
    """``fn()``, retried after each delay while it raises OSError; then ``Unreadable``."""
    sleep = sleep or _sleep
    for attempt in range(len(delays) + 1):
        try:
            return fn()
        except OSError as exc:
            if attempt == len(delays):
                raise Unreadable(f"{what}: {_describe(exc)} (tried {attempt + 1} times)",
                                 exc) from None
            sleep(delays[attempt])
    raise AssertionError("unreachable")


def _describe(exc: OSError) -> str:
    name = os.strerror(exc.errno) if exc.errno else exc.__class__.__name__
    return f"{name}" + (f" [{exc.errno}]" if exc.errno else "")


def read_bytes(path: str) -> bytearray:
    """A file's bytes, with retries (``Unreadable`` once they are used up)."""
    def read() -> bytearray:
        with open(path, "rb") as f:
            return bytearray(f.read())
    return retrying(read, f"cannot read {os.path.basename(path)}")


def listdir(path: str) -> list[str]:
    """``os.listdir`` with retries; a missing directory is empty."""
    def ls() -> list[str]:
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []
    return retrying(ls, f"cannot list {path}")


# -- permissions --------------------------------------------------------------------------
def make_dir(path: str, like: str | None = None) -> None:
    """Create ``path`` (0700, or the mode of the existing directory ``like``) if missing.

    An existing directory is left as it is.
    """
    if os.path.isdir(path):
        return
    mode = DIR_MODE
    if like is not None:
        try:
            mode = stat.S_IMODE(os.stat(like).st_mode)
        except OSError:
            pass
    parent = os.path.dirname(os.path.abspath(path))
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
    os.chmod(path, mode)     # mkdir's mode is masked by the umask; this is what we mean


def file_mode(directory: str) -> int:
    """0600, plus the group/other read bits that ``directory`` grants."""
    try:
        granted = stat.S_IMODE(os.stat(directory).st_mode)
    except OSError:
        granted = 0
    return FILE_MODE | (granted & 0o044)


def create_file(path: str, mode: int) -> int:
    """Open ``path`` for writing, created with exactly ``mode`` (not masked by the umask)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- known-good blobs ---------------------------------------------------------------------
_known: dict[str, dict[str, int]] = {}   # absolute directory -> {blob name: size}
_known_mu = threading.Lock()


def remember_blob(directory: str, name: str, size: int) -> None:
    """Record that blob ``name`` of ``size`` bytes in ``directory`` holds good content."""
    with _known_mu:
        _known.setdefault(os.path.abspath(directory), {})[name] = size


def forget_blob(directory: str, name: str) -> None:
    with _known_mu:
        _known.get(os.path.abspath(directory), {}).pop(name, None)


def forget_directory(directory: str) -> None:
    """Trust nothing in ``directory`` any more (as a fresh process would)."""
    with _known_mu:
        _known.pop(os.path.abspath(directory), None)


def is_known_good(directory: str, name: str, size: int) -> bool:
    with _known_mu:
        return _known.get(os.path.abspath(directory), {}).get(name) == size
