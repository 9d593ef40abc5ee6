"""Job files: how `elasticctl` finds the jobs running on this machine.

Each driver leaves one small JSON file, ``<pid>.json``, in a directory only its
user can read (``$ELASTIC_JOBS_DIR``, else ``~/.elastic/jobs``): where its control
store listens and the job secret. The secret is what lets elasticctl read the
driver's sealed answers and seal its own requests, so the file is 0600 in a 0700
directory, as an ssh key would be. The driver deletes it when it exits; a file
whose process is gone (a SIGKILLed driver) is skipped and removed by the next reader.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from elastic.protocol import ENV_JOBS_DIR


def jobs_dir(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(ENV_JOBS_DIR) or os.path.join(os.path.expanduser("~"), ".elastic", "jobs")


def write(record: Mapping[str, Any], directory: str | None = None) -> str:
    """Write this process's job file; returns its path. OSError when it cannot."""
    directory = directory or jobs_dir()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, f"{os.getpid()}.json")
    temp = f"{path}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(dict(record, pid=os.getpid(), host=socket.gethostname(),
                       started=round(time.time(), 3)), f)
    os.replace(temp, path)
    return path


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running(directory: str | None = None) -> list[dict[str, Any]]:
    """[job record] of the live drivers that left a file here, oldest first."""
    directory = directory or jobs_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    jobs = []
    for name in names:
        stem, dot, ext = name.partition(".")
        if ext != "json" or not stem.isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                record = json.load(f)
            pid = int(record["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if record.get("host") == socket.gethostname() and not _alive(pid):
            remove(path)                 # its driver was killed before it could clean up
            continue
        jobs.append(record)
    return sorted(jobs, key=lambda r: (r.get("started", 0), r["pid"]))
