"""One writer per checkpoint directory: a ``filelock`` lock held by the writing worker.

The lock is an OS file lock on DIR/LOCK, so it goes away with the process that
held it, however that process ends. DIR/LOCK.owner names the job that holds it:
when rank 0 moves within a job, the new writer waits for the previous one to
exit; a different job waits only briefly (a killed predecessor's workers may
still be dying) and then gets CheckpointDirectoryInUse.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from elastic import protocol as control
from elastic.checkpoint import storage
from elastic.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from filelock import BaseFileLock

SAME_JOB_WAIT_S = 600.0


class CheckpointDirectoryInUse(CheckpointError):
    def __init__(self, directory: str, same_job: bool = False) -> None:
        super().__init__(f"checkpoint directory {directory} is in use by "
                         + ("an earlier writer of this job" if same_job else "another job"))
        self.directory = directory
        self.same_job = same_job


class DirectoryUsedTwice(CheckpointError):
    """Two Checkpointers of one process on one directory: a bug in the script."""


def _file_lock(path: str, mode: int) -> BaseFileLock:
    """A flock-based FileLock, never a soft (marker-file) one: a soft lock outlives a
    killed holder. Without flock support, acquiring raises OSError."""
    from filelock import FileLock
    try:
        return FileLock(path, mode=mode, fallback_to_soft=False)
    except TypeError:       # an older filelock: flock only anyway
        return FileLock(path, mode=mode)


class DirectoryLock:
    def __init__(self, directory: str, job_id: str) -> None:
        self.directory = directory
        self.job_id = job_id
        self._lock: BaseFileLock | None = None

    @property
    def held(self) -> bool:
        return self._lock is not None

    def acquire(self, other_job_wait_s: float, same_job_wait_s: float = SAME_JOB_WAIT_S) -> None:
        """Take the lock, waiting as long as its holder's job allows; raises
        CheckpointDirectoryInUse when it stays busy, OSError when the directory
        cannot hold a lock (no flock, no space, no permission)."""
        if self._lock is not None:
            return
        from filelock import Timeout
        storage.make_dir(self.directory)
        lock = _file_lock(os.path.join(self.directory, "LOCK"), storage.file_mode(self.directory))
        began = time.monotonic()
        while True:
            try:
                lock.acquire(timeout=0)
                break
            except Timeout:
                owner = self._owner()
                if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
                    raise DirectoryUsedTwice(f"checkpoint directory {self.directory} is already "
                                             "used by another Checkpointer of this process") from None
                same = owner.get("job") == self.job_id
                if time.monotonic() - began >= (same_job_wait_s if same else other_job_wait_s):
                    raise CheckpointDirectoryInUse(self.directory, same_job=same) from None
                time.sleep(0.1)
        try:
            self._write_owner()
        except BaseException:
            lock.release()
            raise
        self._lock = lock

    def _write_owner(self) -> None:
        owner = os.path.join(self.directory, "LOCK.owner")
        data = json.dumps({"job": self.job_id, "host": socket.gethostname(),
                           "pid": os.getpid()}).encode()
        fd = storage.create_file(owner + ".tmp", storage.file_mode(self.directory))
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(owner + ".tmp", owner)

    def release(self) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            try:
                lock.release()
            except OSError:
                pass            # the descriptor closes anyway, and with it the flock

    def _owner(self) -> dict[str, Any]:
        try:
            with open(os.path.join(self.directory, "LOCK.owner")) as f:
                owner = json.load(f)
            return owner if isinstance(owner, dict) else {}
        except (OSError, ValueError):
            return {}


def job_id(salt: object) -> str:
    """The same for every worker of one elasticrun job; ``salt`` makes it unique standalone."""
    try:
        secret = control.read_secret_from_env() if os.environ.get(control.ENV_ADDR) else None
    except control.ControlError:
        secret = None
    if secret:
        return hashlib.sha256(b"elastic-checkpoint-owner/" + secret).hexdigest()[:32]
    return f"standalone/{socket.gethostname()}/{os.getpid()}/{salt}"
