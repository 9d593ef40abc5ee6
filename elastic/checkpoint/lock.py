"""One writer per checkpoint directory: a ``filelock`` lock held by the writing worker.

The lock is an OS file lock on DIR/LOCK, so it goes away with the process that
held it, however that process ends. DIR/LOCK.owner names the job that holds it:
when rank 0 moves within a job, the new writer waits for the previous one to
exit; a different job waits only briefly (a killed predecessor's workers may
still be dying) and then gets CheckpointDirectoryInUse.
"""

import hashlib
import json
import os
import socket
import time

from elastic import protocol as control
from elastic.checkpoint.format import CheckpointError

SAME_JOB_WAIT_S = 600.0


class CheckpointDirectoryInUse(CheckpointError):
    def __init__(self, directory):
        super().__init__(f"checkpoint directory {directory} is in use by another job")
        self.directory = directory


class DirectoryLock:
    def __init__(self, directory, job_id):
        self.directory = directory
        self.job_id = job_id
        self._lock = None

    @property
    def held(self):
        return self._lock is not None

    def acquire(self, other_job_wait_s):
        if self._lock is not None:
            return
        from filelock import FileLock, Timeout
        os.makedirs(self.directory, exist_ok=True)
        lock = FileLock(os.path.join(self.directory, "LOCK"))
        began = time.monotonic()
        while True:
            try:
                lock.acquire(timeout=0)
                break
            except Timeout:
                owner = self._owner()
                if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
                    raise CheckpointError(f"checkpoint directory {self.directory} is already "
                                          "used by another Checkpointer of this process") from None
                same = owner.get("job") == self.job_id
                if time.monotonic() - began >= (SAME_JOB_WAIT_S if same else other_job_wait_s):
                    raise CheckpointDirectoryInUse(self.directory) from None
                time.sleep(0.1)
        self._lock = lock
        owner = os.path.join(self.directory, "LOCK.owner")
        with open(owner + ".tmp", "w") as f:
            json.dump({"job": self.job_id, "host": socket.gethostname(), "pid": os.getpid()}, f)
        os.replace(owner + ".tmp", owner)

    def release(self):
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _owner(self):
        try:
            with open(os.path.join(self.directory, "LOCK.owner")) as f:
                owner = json.load(f)
            return owner if isinstance(owner, dict) else {}
        except (OSError, ValueError):
            return {}


def job_id(salt):
    """The same for every worker of one elasticrun job; ``salt`` makes it unique standalone."""
    try:
        secret = control.read_secret_from_env() if os.environ.get(control.ENV_ADDR) else None
    except control.ControlError:
        secret = None
    if secret:
        return hashlib.sha256(b"elastic-checkpoint-owner/" + secret).hexdigest()[:32]
    return f"standalone/{socket.gethostname()}/{os.getpid()}/{salt}"
