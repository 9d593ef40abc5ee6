"""Durable checkpoints: written in the background from the committed snapshot.

``TorchState(..., elastic_checkpoint=Checkpointer(dir, every_commits=N, every_seconds=S, keep=K))``.
Only rank 0 of the current round writes, holding a ``filelock`` lock on the
directory for as long as it is the writer; a second job that points at the same
directory stops with one line. The writer thread reads the committed snapshot's
own host buffers: nothing is copied to write a checkpoint. If the next commit
comes while the writer still reads some of them, that commit does not wait and
does not overwrite them: those tensors go into spare buffers, which are reused
from one write to the next (extra memory: at most one snapshot, usually the
part the writer has not hashed yet). The format is in format.py; what a
misbehaving directory does (one warning, training goes on) in storage.py and below.

On the first sync of a fresh job, rank 0 loads the newest good checkpoint and
takes over its commit version; the others then receive it by the normal sync,
whatever the world size.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from elastic import protocol
from elastic.checkpoint import format as store
from elastic.checkpoint import resume
from elastic.checkpoint.format import CheckpointError, CorruptCheckpoint, list_checkpoints  # noqa: F401
from elastic.checkpoint.lock import (
    SAME_JOB_WAIT_S,
    CheckpointDirectoryInUse,
    DirectoryLock,
    DirectoryUsedTwice,
    job_id,
)
from elastic.checkpoint.writer import write_checkpoint
from elastic.protocol import env_float
from elastic.worker import fatal

if TYPE_CHECKING:
    from elastic.state.snapshot import Snapshot
    from elastic.state.states import State
    from elastic.worker.round_view import RoundView

log = logging.getLogger(__name__)
ENV_DIR = protocol.ENV_CHECKPOINT_DIR
DEFAULT_EVERY_COMMITS = 10
DEFAULT_EVERY_SECONDS = 60.0
Job = tuple[int, Any, list[torch.Tensor], int]   # (version, skeleton, buffers, world size) to write
SpareKey = tuple[tuple[int, ...], torch.dtype, bool]   # (shape, dtype, pinned)


def _warn(message: str) -> None:
    sys.stderr.write(f"elastic: warning: {message}\n")
    sys.stderr.flush()


class Checkpointer:
    """Periodic, asynchronous, incremental and atomic checkpoints of one state.

    A checkpoint is due at a commit once ``every_commits`` commits or
    ``every_seconds`` seconds have passed since the last one (either; with
    neither given: 10 commits or 60 s). A due checkpoint waits for the next
    commit while the previous write is still running. The newest ``keep``
    checkpoints are kept.
    """

    def __init__(self, directory: str | os.PathLike, every_commits: int | None = None,
                 every_seconds: float | None = None, keep: int = 3, unusable: str | None = None):
        """``directory`` is created by the writer (0700). Environment: ELASTIC_CHECKPOINT_LOCK_WAIT
        (seconds to wait for a directory locked by another job, default 10: its killed
        workers may still be exiting); ELASTIC_CHECKPOINT_WRITE_TIMEOUT (default 600);
        ELASTIC_CHECKPOINT_RETRY (seconds between tries to take the lock after it
        failed, default 5). ``unusable``: what a rerun does when the newest checkpoint
        cannot be used, "previous" (default) or "stop" (resume.py; elasticrun's
        --on-unusable-checkpoint sets ELASTIC_CHECKPOINT_UNUSABLE)."""
        if not directory:
            raise ValueError("Checkpointer needs a directory")
        if every_commits is not None and (int(every_commits) != every_commits or every_commits < 1):
            raise ValueError(f"every_commits must be a whole number >= 1, got {every_commits!r}")
        if every_seconds is not None and not every_seconds > 0:
            raise ValueError(f"every_seconds must be > 0, got {every_seconds!r}")
        if int(keep) != keep or keep < 1:
            raise ValueError(f"keep must be a whole number >= 1, got {keep!r}")
        if every_commits is None and every_seconds is None:
            every_commits, every_seconds = DEFAULT_EVERY_COMMITS, DEFAULT_EVERY_SECONDS
        self.directory = os.path.abspath(os.fspath(directory))
        self.every_commits = None if every_commits is None else int(every_commits)
        self.every_seconds = every_seconds
        self.keep = int(keep)
        # An unusable newest checkpoint: "previous" (fall back, one warning) or "stop".
        self.unusable = resume.choice(unusable or os.environ.get(protocol.ENV_CHECKPOINT_UNUSABLE))
        self.lock_wait_s = env_float(protocol.ENV_CHECKPOINT_LOCK_WAIT, 10.0)
        self.write_timeout_s = env_float(protocol.ENV_CHECKPOINT_WRITE_TIMEOUT, 600.0)
        self.retry_s = env_float(protocol.ENV_CHECKPOINT_RETRY, 5.0)
        # Test hooks: slow down phase 1 (while the buffers are read) / phase 2 (durability).
        self.test_hold_s = env_float(protocol.ENV_CHECKPOINT_TEST_HOLD, 0.0)
        self.test_delay_s = env_float(protocol.ENV_CHECKPOINT_TEST_DELAY, 0.0)
        self.resumed_from: dict[str, Any] | None = None   # {"version", "path"} once one was loaded
        self.stats: dict[str, Any] = {"checkpoints": 0, "bytes_written": 0, "bytes_total": 0, "failures": 0,
                                      "deferred": 0, "swapped_commits": 0, "swapped_bytes": 0,
                                      "last": None}
        self._state: State | None = None
        self._round: RoundView | None = None   # the RoundView of the last sync (None: standalone)
        self._world_size = 1
        self._lock = DirectoryLock(self.directory, job_id(id(self)))
        self._resume_tried = False
        self._wants_lock = False     # rank 0 of the current round: should be the writer
        self._retry_at = 0.0         # no lock attempt before this (monotonic)
        self._busy_since: float | None = None   # the lock has been held by someone else since
        self._trouble: str | None = None        # what failed, while checkpoints are off (one warning)
        self._trouble_mu = threading.Lock()
        self._last_version = -1      # newest version on disk, as far as the writer knows
        self._since_commits = 0
        self._last_time = time.monotonic()
        self._cond = threading.Condition()
        self._mu = threading.Lock()
        self._unread: dict[int, torch.Tensor] = {}  # index -> snapshot buffer the writer has yet to read
        self._retired: list[torch.Tensor] = []  # buffers swapped out of the snapshot while being read
        self._spares: dict[SpareKey, list[torch.Tensor]] = {}  # buffers to reuse
        self._busy = False
        self._job: Job | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._atexit: Callable[..., None] | None = None

    @property
    def writing(self) -> bool:
        """A checkpoint is being written now."""
        return self._busy

    @property
    def is_writer(self) -> bool:
        return self._lock.held

    # -- hooks called by State ------------------------------------------------------------
    def before_sync(self, state: State, view: RoundView | None = None) -> None:
        """Rank 0 of ``view``'s round (or a state alone, ``view`` None): take the lock,
        and in a fresh job load the newest good checkpoint.

        Only another job holding the directory stops a fresh job (one line). Any
        other failure (no space, no permission, no flock) gives one warning:
        training goes on without checkpoints and the lock is tried again later.
        """
        if self._state is not None and self._state is not state:
            raise ValueError("a Checkpointer serves a single state")
        self._state = state
        self._round = view
        m = view.membership if view is not None else None
        if view is not None and (m is None or m.rank != 0):
            self._wants_lock = False
            self._release()
            return
        self._wants_lock = True
        self._world_size = m.size if m is not None else 1
        if self._atexit is None:
            self._atexit = self.close
            atexit.register(self._atexit)
        if state.commit_version >= 0 or self._resume_tried:
            self._try_acquire()          # a new rank 0 taking over: never block the sync
            return
        self._resume_tried = True
        try:
            self._acquire(self.lock_wait_s)
        except CheckpointDirectoryInUse as exc:
            if not exc.same_job:
                # One line and a non-zero exit, not a traceback (sys.exit keeps the exit code).
                sys.exit(f"elastic: {exc}")
            self._retry_at = time.monotonic() + self.retry_s
            self._failed("taking the directory lock", exc)
        except DirectoryUsedTwice:
            raise
        except Exception as exc:  # noqa: BLE001 - a bad directory must not end the worker
            self._retry_at = time.monotonic() + self.retry_s
            self._failed("taking the directory lock", exc)
        self._resume(state)

    def before_save(self, snapshot: Snapshot) -> None:
        """Never wait for the writer: give it the buffers it still reads, take spares
        (``Snapshot.swap_buffer``)."""
        with self._mu:
            if not self._unread:
                if self._retired:
                    self._recycle(snapshot.buffers)
                return
            buffers = snapshot.buffers
            for i, buf in self._unread.items():
                if i < len(buffers) and buffers[i] is buf:
                    key = (tuple(buf.shape), buf.dtype, buf.is_pinned())
                    pool = self._spares.get(key)
                    spare = pool.pop() if pool else torch.empty(
                        buf.shape, dtype=buf.dtype, pin_memory=key[2])
                    snapshot.swap_buffer(i, buf, spare)
                    self._retired.append(buf)
                    self.stats["swapped_bytes"] += buf.numel() * buf.element_size()
            self.stats["swapped_commits"] += 1

    def _recycle(self, buffers: list[torch.Tensor]) -> None:
        """Retired buffers become spares; keep no more spares than the snapshot has buffers."""
        wanted: dict[SpareKey, int] = {}
        for b in buffers:
            key = (tuple(b.shape), b.dtype, b.is_pinned())
            wanted[key] = wanted.get(key, 0) + 1
        for b in self._retired:
            key = (tuple(b.shape), b.dtype, b.is_pinned())
            pool = self._spares.setdefault(key, [])
            if len(pool) < wanted.get(key, 0):
                pool.append(b)
        self._retired = []

    def committed(self, version: int, snapshot: Snapshot) -> None:
        """A commit listener (State.add_commit_listener): hand commit ``version``, just
        saved in ``snapshot``, to the writer thread when a checkpoint is due."""
        if not self._lock.held:
            if self._wants_lock:
                self._try_acquire()
            if not self._lock.held:
                return
        self._since_commits += 1
        due = ((self.every_commits is not None and self._since_commits >= self.every_commits)
               or (self.every_seconds is not None
                   and time.monotonic() - self._last_time >= self.every_seconds))
        if due:
            self._submit(version, snapshot)

    # -- public ---------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Block until no checkpoint is being written; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, final: bool = True) -> None:
        """Finish the write in flight, write the last commit if newer (``final``), unlock."""
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        if final and self._wants_lock and not self._lock.held:
            self._retry_at = 0.0
            self._try_acquire()
        if self._lock.held and self.wait(self.write_timeout_s):
            state = self._state
            if final and state is not None and not state.snapshot.empty \
                    and state.commit_version > max(self._last_version, 0):
                # On this thread: at exit, no new thread may be allowed to start.
                self._write(self._job_of(state.commit_version, state.snapshot))
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._lock.release()

    # -- internals ------------------------------------------------------------------------
    def _resume(self, state: State) -> None:
        """Load the newest checkpoint that loads; without the lock, read-only (nothing
        quarantined). resume.py says what happens to the ones that cannot be used."""
        try:
            found = resume.newest_usable(self.directory, state, self.unusable, _warn,
                                         quarantine=self._lock.held)
        except resume.Refused as exc:
            fatal.stop_job(str(exc))
        except Exception as exc:  # noqa: BLE001 - e.g. the directory cannot be listed
            _warn(f"cannot look for checkpoints in {self.directory} ({exc}); "
                  "starting without one")
            return
        if found is None:
            return
        version, path, above = found
        self._last_version = max(self._last_version, above)
        self._since_commits, self._last_time = 0, time.monotonic()
        self.resumed_from = {"version": version, "path": path}
        self._tell_driver(version)
        log.info("resumed from checkpoint %s (commit %s)", path, version)

    def _submit(self, version: int, snap: Snapshot) -> None:
        with self._cond:
            if self._busy:
                self.stats["deferred"] += 1
                return
            self._busy = True
            with self._mu:
                if self._retired:
                    self._recycle(snap.buffers)
                self._unread = dict(enumerate(snap.buffers))
            self._job = self._job_of(version, snap)
            self._since_commits, self._last_time = 0, time.monotonic()
            if self._thread is None or not self._thread.is_alive():
                self._closing = False
                self._thread = threading.Thread(target=self._writer, daemon=True,
                                                name="elastic-checkpoint-writer")
                self._thread.start()
            self._cond.notify_all()

    def _prefill_spares(self, buffers: list[torch.Tensor]) -> None:
        """Pinned allocation is slow (cudaHostAlloc) and must not land on the training
        thread: make here, on the writer thread, the spares that a commit during this
        write will swap in (``before_save``)."""
        wanted: dict[SpareKey, int] = {}
        for b in buffers:
            if b.is_pinned():
                key = (tuple(b.shape), b.dtype, True)
                wanted[key] = wanted.get(key, 0) + 1
        for key, count in wanted.items():
            with self._mu:
                missing = count - len(self._spares.get(key, [])) - sum(
                    1 for r in self._retired if (tuple(r.shape), r.dtype, r.is_pinned()) == key)
            fresh = [torch.empty(key[0], dtype=key[1], pin_memory=True) for _ in range(missing)]
            if fresh:
                with self._mu:
                    self._spares.setdefault(key, []).extend(fresh)

    def _job_of(self, version: int, snap: Snapshot) -> Job:
        return version, snap.skeleton, list(snap.buffers), self._world_size

    def _writer(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closing:
                    self._cond.wait()
                if self._job is None:
                    return
                job, self._job = self._job, None
            try:
                self._prefill_spares(job[2])
                self._write(job)
            finally:
                self._read(None)
                del job
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, job: Job) -> None:
        version, skeleton, buffers, size = job
        try:
            result = write_checkpoint(
                self.directory, version, skeleton, buffers, released=self._read,
                info={"world_size": size}, hold_s=self.test_hold_s, delay_s=self.test_delay_s)
            pruned = time.perf_counter()
            store.prune(self.directory, self.keep)
            result["prune_s"] = time.perf_counter() - pruned
        except Exception as exc:  # noqa: BLE001 - training goes on; the next one retries
            self._failed(f"writing the checkpoint of commit {version}", exc)
            return
        self._recovered()
        self._last_version = max(self._last_version, version)
        self._tell_driver(version)
        self.stats["checkpoints"] += 1
        self.stats["bytes_written"] += result["bytes_written"]
        self.stats["bytes_total"] += result["bytes_total"]
        self.stats["last"] = result

    def _read(self, index: int | None) -> None:
        with self._mu:
            if index is None:
                self._unread = {}
            else:
                self._unread.pop(index, None)

    def _acquire(self, wait_s: float) -> None:
        """Take the lock (``wait_s`` for another job, as long for this job's earlier
        writer), then clear what dead writers left. Raises whatever failed."""
        if self._lock.held:
            return
        self._lock.acquire(wait_s, same_job_wait_s=SAME_JOB_WAIT_S if wait_s else 0)
        try:
            store.remove_temps(self.directory)
            on_disk = list_checkpoints(self.directory)
        except BaseException:
            self._lock.release()
            raise
        self._last_version = max([self._last_version] + [v for v, _ in on_disk[-1:]])
        self._since_commits, self._last_time = 0, time.monotonic()
        self._busy_since = None

    def _try_acquire(self) -> None:
        """One attempt that never waits; the next comes at a later commit."""
        now = time.monotonic()
        if self._lock.held or now < self._retry_at:
            return
        try:
            self._acquire(0)
        except CheckpointDirectoryInUse as exc:
            # Usually the previous rank 0 finishing its write or exiting: quiet, unless it lasts.
            self._busy_since = self._busy_since or now
            self._retry_at = now + min(self.retry_s, 1.0)
            if now - self._busy_since >= max(self.lock_wait_s, 1.0):
                self._failed("taking the directory lock", exc)
            return
        except DirectoryUsedTwice:
            raise
        except Exception as exc:  # noqa: BLE001 - a bad directory must not end the worker
            self._retry_at = now + self.retry_s
            self._failed("taking the directory lock", exc)
            return
        self._recovered()

    def _failed(self, what: str, exc: BaseException) -> None:
        """Count a failure; warn about the first of a run of them only."""
        self.stats["failures"] += 1
        with self._trouble_mu:
            first, self._trouble = self._trouble is None, what
        if first:
            _warn(f"{what} in {self.directory} failed ({exc}); training goes on without "
                  "checkpoints and tries again later")

    def _recovered(self) -> None:
        with self._trouble_mu:
            was, self._trouble = self._trouble, None
        if was is not None:
            log.info("checkpoints to %s work again", self.directory)

    def _tell_driver(self, version: int) -> None:
        """Heartbeats say the newest checkpoint: a job whose every holder of the state is
        gone may then resume from it (runner/holders.py)."""
        view = self._round
        if view is not None:
            view.progress.durable = max(view.progress.durable, int(version))

    def _release(self) -> None:
        if self._lock.held:
            self.wait(self.write_timeout_s)
            self._lock.release()


def resolve(checkpoint: Checkpointer | str | os.PathLike | bool | None) -> Checkpointer | None:
    """The Checkpointer a TorchState uses: the one given, else $ELASTIC_CHECKPOINT_DIR's."""
    if checkpoint is False:
        return None
    if checkpoint is None:
        directory = os.environ.get(ENV_DIR)
        return Checkpointer(directory) if directory else None
    if isinstance(checkpoint, (str, os.PathLike)):
        return Checkpointer(checkpoint)
    if not isinstance(checkpoint, Checkpointer):
        raise TypeError(f"checkpoint must be an elastic.Checkpointer, got {type(checkpoint)!r}")
    return checkpoint


def load(directory: str | os.PathLike) -> tuple[int, Any] | None:
    """(version, tree) of the newest good checkpoint in ``directory``, or None.

    ``tree`` is what the state captured: ``tree["model"]`` and ``tree["optimizer"]``
    are ordinary state_dicts (save them with torch.save for other tools), and
    ``tree["objects"]`` holds the other attributes. Reads only; takes no lock.
    """
    found = store.load_newest(os.fspath(directory), warn=_warn)
    return None if found is None else found[:2]
