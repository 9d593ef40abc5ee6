"""Removing a secret from this process's environment, including the copy the kernel
shows in /proc/PID/environ.

``os.environ.pop`` (unsetenv) keeps children from inheriting a variable, but
/proc/PID/environ shows the environment block the process was started with, which
unsetenv does not touch: anyone who may read that file (the same user, root, a
debugging sidecar) would still read the secret. So the value is also overwritten
in place in that block (its address is in /proc/self/stat: env_start, env_end),
with ``*`` of the same length. Linux only; elsewhere only unsetenv happens.
"""

import ctypes
import os
from collections.abc import Iterable


def _env_block() -> tuple[int, int] | None:
    """(start, end) addresses of this process's initial environment block, or None."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        # Fields 50 and 51 (env_start, env_end), counted from 1, after the ")" at field 2.
        return int(fields[47]), int(fields[48])
    except (OSError, IndexError, ValueError):
        return None


def _wipe(names: Iterable[str]) -> None:
    block = _env_block()
    if block is None or block[1] <= block[0]:
        return
    start, end = block
    data = ctypes.string_at(start, end - start)
    for name in names:
        prefix = b"\0" + name.encode() + b"="
        offset = 0
        while True:
            found = (b"\0" + data).find(prefix, offset)
            if found < 0:
                break
            value_at = found + len(prefix) - 1            # in data (the \0 was prepended)
            value_end = data.find(b"\0", value_at)
            value_end = len(data) if value_end < 0 else value_end
            ctypes.memset(start + value_at, ord("*"), value_end - value_at)
            offset = value_end + 1


def forget_env(names: Iterable[str]) -> None:
    """Remove ``names`` from os.environ (children do not inherit them) and blank their
    values in /proc/self/environ."""
    try:
        _wipe(names)
    except (OSError, ValueError):
        pass
    for name in names:
        os.environ.pop(name, None)
