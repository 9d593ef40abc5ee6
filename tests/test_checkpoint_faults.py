"""A checkpoint store that never destroys good data, and a bad directory never ends a worker.

Real filesystems where it matters: a tmpfs this test mounts (as root) and fills
for ENOSPC, a read-only remount for EROFS, a process run as ``nobody`` for
EACCES, a real EMFILE from a lowered fd limit, a file replaced by a directory
for a read that fails. Injected OSErrors only for the backoff schedule and for
a filesystem without flock (none is at hand here).
"""

import contextlib
import errno
import fcntl
import os
import resource
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from elastic.checkpoint import format as store
from elastic.checkpoint import storage
from elastic.checkpoint.checkpointer import Checkpointer
from elastic.checkpoint.errors import Unreadable
from elastic.checkpoint.writer import write_checkpoint
from elastic.protocol import ENV_ADDR
from elastic.state.states import TorchState
from elastic.worker import runtime

sys.path.insert(0, os.path.dirname(__file__))
from support.jobs import REPO, Job  # noqa: E402

WARNING = "elastic: warning:"


@pytest.fixture(autouse=True)
def standalone(monkeypatch):
    monkeypatch.delenv(ENV_ADDR, raising=False)
    monkeypatch.delenv("ELASTIC_CHECKPOINT_DIR", raising=False)
    runtime.shutdown()
    yield
    runtime.shutdown()


@contextlib.contextmanager
def tmpfs(path, size):
    """A real small filesystem at ``path``, always unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                           str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path, options):
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


def fill(path):
    """Fill the filesystem of ``path`` to the last byte; returns the filler file."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    chunk = 1 << 16
    try:
        while chunk:
            try:
                os.write(fd, b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                chunk //= 2
    finally:
        os.close(fd)
    return filler


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(200, 100, generator=g), torch.arange(7),
            torch.randn(40_000, generator=g, dtype=torch.float64)]


def _write(directory, version, tensors):
    return write_checkpoint(str(directory), version, {"v": version}, tensors)


def _corrupt_names(directory):
    return sorted(n for d in (directory, directory / "blobs") if d.is_dir()
                  for n in os.listdir(d) if n.endswith(".corrupt"))


def _warnings(text):
    return [line for line in text.splitlines() if WARNING in line]


def _model(width):
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(state, model, optimizer, commits):
    for _ in range(commits):
        optimizer.zero_grad()
        model(torch.ones(1, model.in_features)).sum().backward()
        optimizer.step()
        state.commit()
        state.checkpointer.wait(60)


# -- reading: only a checksum mismatch means corrupt -------------------------------------------
def test_backoff_retries_oserrors_then_gives_up_as_unreadable():
    calls, slept = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError(errno.EIO, "Input/output error")
        return "ok"

    assert storage.retrying(flaky, "x", sleep=slept.append) == "ok"
    assert slept == list(storage.RETRY_DELAYS_S[:2])
    slept.clear()

    def broken():
        raise OSError(errno.ESTALE, "Stale file handle")

    with pytest.raises(Unreadable, match=r"Stale file handle \[116\] \(tried 4 times\)"):
        storage.retrying(broken, "x", sleep=slept.append)
    assert slept == list(storage.RETRY_DELAYS_S) and slept == sorted(slept)


def test_a_read_that_fails_skips_the_checkpoint_and_renames_nothing(tmp_path):
    tensors = _tensors()
    _write(tmp_path, 1, tensors)
    tensors[2].mul_(2)
    _write(tmp_path, 2, tensors)
    body = store.read_manifest(store.manifest_path(str(tmp_path), 2))
    only_new = store.blob_path(str(tmp_path), body["tensors"][2]["blob"])
    os.rename(only_new, only_new + ".aside")
    os.mkdir(only_new)                        # open() fails: EISDIR, every time
    warnings = []
    version, _tree, _path = store.load_newest(str(tmp_path), warn=warnings.append, quarantine=True)
    assert version == 1
    assert len(warnings) == 1 and "skipped for this load, nothing renamed" in warnings[0], warnings
    assert "Is a directory" in warnings[0] and "tried 4 times" in warnings[0]
    assert [v for v, _ in store.list_checkpoints(str(tmp_path))] == [1, 2]
    assert not _corrupt_names(tmp_path)
    store.prune(str(tmp_path), keep=2)
    os.rmdir(only_new)                        # the error goes away: the newest loads again
    os.rename(only_new + ".aside", only_new)
    assert store.load_newest(str(tmp_path), warn=warnings.append)[0] == 2
    assert len(warnings) == 1


def test_a_transient_emfile_is_retried_and_the_newest_checkpoint_loads(tmp_path, monkeypatch):
    _write(tmp_path, 1, _tensors())
    _write(tmp_path, 2, _tensors(seed=1))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held, slept = [], []

    def sleep(seconds):          # the first backoff: the process frees its descriptors
        slept.append(seconds)
        while held:
            os.close(held.pop())

    monkeypatch.setattr(storage, "_sleep", sleep)
    warnings = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))     # a real EMFILE from here
        with pytest.raises(OSError) as info:
            os.open(os.devnull, os.O_RDONLY)
        assert info.value.errno == errno.EMFILE
        found = store.load_newest(str(tmp_path), warn=warnings.append, quarantine=True)
    finally:
        while held:
            os.close(held.pop())
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert found is not None and found[0] == 2, warnings
    assert slept, "the read should have failed with EMFILE at least once"
    assert not warnings and not _corrupt_names(tmp_path)


def test_only_a_checksum_mismatch_quarantines_and_quarantine_is_never_pruned(tmp_path):
    tensors = _tensors()
    _write(tmp_path, 1, tensors)
    tensors[0].add_(1)
    _write(tmp_path, 2, tensors)
    body = store.read_manifest(store.manifest_path(str(tmp_path), 2))
    bad = store.blob_path(str(tmp_path), body["tensors"][0]["blob"])
    data = bytearray(open(bad, "rb").read())
    data[100] ^= 0xFF
    open(bad, "wb").write(bytes(data))
    warnings = []
    assert store.load_newest(str(tmp_path), warn=warnings.append, quarantine=True)[0] == 1
    assert "is corrupt" in warnings[0] and "quarantined as *.corrupt" in warnings[0]
    quarantined = _corrupt_names(tmp_path)
    assert quarantined == sorted([os.path.basename(bad) + ".corrupt", "ckpt-000000000002.json.corrupt"])
    for version in range(3, 8):               # many writes and prunes later, keep=1
        tensors[0].add_(1)
        _write(tmp_path, version, tensors)
        store.prune(str(tmp_path), keep=1)
    assert _corrupt_names(tmp_path) == quarantined
    assert [v for v, _ in store.list_checkpoints(str(tmp_path))] == [7]


# -- reuse only known-good blobs ---------------------------------------------------------------
def test_a_blob_is_reused_only_when_it_is_known_good(tmp_path):
    tensors = _tensors()
    _write(tmp_path, 1, tensors)
    big = tensors[2].numel() * tensors[2].element_size()
    assert _write(tmp_path, 2, tensors)["bytes_written"] < 1024      # written here: known
    body = store.read_manifest(store.manifest_path(str(tmp_path), 2))
    path = store.blob_path(str(tmp_path), body["tensors"][2]["blob"])
    data = bytearray(open(path, "rb").read())
    data[5] ^= 0xFF                           # bit rot, same size
    open(path, "wb").write(bytes(data))
    storage.forget_directory(str(tmp_path))   # as a new rank 0 (another process) would
    third = _write(tmp_path, 3, tensors)
    assert third["bytes_written"] >= big, third         # not trusted: written again
    store.read_checkpoint(str(tmp_path), store.read_manifest(third["path"]))   # verifies
    storage.forget_directory(str(tmp_path))
    assert store.load_newest(str(tmp_path))[0] == 3      # a resume verifies every blob...
    assert _write(tmp_path, 4, tensors)["bytes_written"] < 1024     # ...so they are reused


# -- permissions -------------------------------------------------------------------------------
def _modes(directory):
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            p = os.path.join(root, name)
            out[os.path.relpath(p, directory)] = stat.S_IMODE(os.stat(p).st_mode)
    return out


def _checkpoint_once(directory):
    model, optimizer = _model(64)
    ck = Checkpointer(directory, every_commits=1)
    state = TorchState(model, optimizer, elastic_checkpoint=ck)
    state.sync()
    _train(state, model, optimizer, 1)
    ck.close()


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_files_and_directories_are_owner_only(tmp_path, umask_022):
    directory = tmp_path / "fresh" / "ckpt"
    _checkpoint_once(directory)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    modes = _modes(directory)
    assert modes["blobs"] == 0o700 and "LOCK" in modes and "LOCK.owner" in modes
    assert [n for n in modes if n.startswith("ckpt-")] and [n for n in modes if "blobs/" in n]
    assert {m for n, m in modes.items() if n != "blobs"} == {0o600}, modes


def test_an_existing_directory_keeps_its_permissions(tmp_path, umask_022):
    directory = tmp_path / "shared"
    directory.mkdir()
    os.chmod(directory, 0o750)                # an operator's group-readable directory
    _checkpoint_once(directory)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o750
    modes = _modes(directory)
    assert modes["blobs"] == 0o750
    assert {m for n, m in modes.items() if n != "blobs"} == {0o640}, modes
    storage.forget_directory(str(directory))
    os.chmod(directory, 0o777)                # open to all: files are readable, not writable
    _checkpoint_once(directory)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o777
    newest = store.list_checkpoints(str(directory))[-1][1]
    assert stat.S_IMODE(os.stat(newest).st_mode) == 0o644


# -- a misbehaving directory never ends a worker -----------------------------------------------
def test_enospc_on_a_real_full_filesystem_warns_once_and_recovers(tmp_path, capfd):
    with tmpfs(tmp_path / "mnt", "256k") as mnt:
        model, optimizer = _model(512)                     # 1 MB of weights: does not fit
        ck = Checkpointer(mnt / "ckpt", every_commits=1)
        state = TorchState(model, optimizer, elastic_checkpoint=ck)
        state.sync()
        assert ck.is_writer
        _train(state, model, optimizer, 4)
        assert ck.stats["failures"] == 4 and ck.stats["checkpoints"] == 0
        assert not store.list_checkpoints(str(mnt / "ckpt"))
        left = os.listdir(mnt / "ckpt") + os.listdir(mnt / "ckpt" / "blobs")
        assert not [n for n in left if n.endswith(".tmp")], left
        remount(mnt, "size=16m")                           # space again: the next one works
        _train(state, model, optimizer, 2)
        assert ck.stats["checkpoints"] == 2
        assert store.load_newest(str(mnt / "ckpt"))[0] == state.commit_version
        ck.close()
    err = capfd.readouterr().err
    warnings = _warnings(err)
    assert len(warnings) == 1, err
    assert "No space left on device" in warnings[0] and "training goes on" in warnings[0]
    assert err.count("work again") == 1


def test_a_read_only_directory_still_resumes_and_training_goes_on(tmp_path, capfd):
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        model, optimizer = _model(16)
        ck = Checkpointer(mnt / "ckpt", every_commits=1)
        state = TorchState(model, optimizer, elastic_checkpoint=ck)
        state.sync()
        _train(state, model, optimizer, 3)
        ck.close()
        remount(mnt, "ro")                      # EROFS for everything that writes
        model2, optimizer2 = _model(16)
        ck2 = Checkpointer(mnt / "ckpt", every_commits=1)
        ck2.retry_s = 0.0
        again = TorchState(model2, optimizer2, elastic_checkpoint=ck2)
        again.sync()                            # the lock fails; the load works, read-only
        assert ck2.resumed_from["version"] == 3 and again.commit_version == 3
        assert torch.equal(model2.weight, model.weight)
        _train(again, model2, optimizer2, 3)
        assert again.commit_version == 6 and not ck2.is_writer
        ck2.close()
        remount(mnt, "rw")
    warnings = _warnings(capfd.readouterr().err)
    assert len(warnings) == 1 and "Read-only file system" in warnings[0], warnings


def test_a_full_disk_while_taking_the_lock_over_warns_once_and_retries(tmp_path, capfd):
    with tmpfs(tmp_path / "mnt", "256k") as mnt:
        filler = fill(mnt)
        model, optimizer = _model(16)
        ck = Checkpointer(mnt / "ckpt", every_commits=1)
        ck.retry_s = 0.0
        state = TorchState(model, optimizer, elastic_checkpoint=ck)
        state.sync()                                        # LOCK.owner: ENOSPC
        assert not ck.is_writer
        _train(state, model, optimizer, 3)                  # each commit retries, quietly
        assert not ck.is_writer and ck.stats["failures"] >= 3
        filler.unlink()
        _train(state, model, optimizer, 2)
        assert ck.is_writer and ck.stats["checkpoints"] >= 1
        ck.close()
        assert store.load_newest(str(mnt / "ckpt"))[0] == state.commit_version
    warnings = _warnings(capfd.readouterr().err)
    assert len(warnings) == 1 and "taking the directory lock" in warnings[0], warnings
    assert "No space left on device" in warnings[0]


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.ENOLCK], ids=["ENOSYS", "ENOLCK"])
def test_a_filesystem_without_flock_warns_once_and_training_goes_on(tmp_path, capfd,
                                                                   monkeypatch, code):
    def no_flock(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    model, optimizer = _model(16)
    ck = Checkpointer(tmp_path / "ckpt", every_commits=1)
    ck.retry_s = 0.0
    state = TorchState(model, optimizer, elastic_checkpoint=ck)
    state.sync()
    _train(state, model, optimizer, 3)
    assert not ck.is_writer and state.commit_version == 3
    monkeypatch.undo()
    _train(state, model, optimizer, 1)
    assert ck.is_writer
    ck.close()
    warnings = _warnings(capfd.readouterr().err)
    assert len(warnings) == 1 and os.strerror(code) in warnings[0], warnings
    assert not [n for n in os.listdir(tmp_path / "ckpt") if "soft" in n.lower()]


EACCES_SCRIPT = textwrap.dedent("""
    import sys, torch
    from elastic.checkpoint.checkpointer import Checkpointer
    from elastic.state.states import TorchState
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = Checkpointer(sys.argv[1], every_commits=1)
    ck.retry_s = 0.0
    state = TorchState(model, opt, elastic_checkpoint=ck)
    state.sync()
    for _ in range(3):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        state.commit()
    ck.close()
    print("trained", state.commit_version, "writer", ck.is_writer, "failures", ck.stats["failures"])
""")


@pytest.mark.slow
def test_a_directory_without_write_permission_warns_once(tmp_path):
    """EACCES for real: as root, in a process without the capability to override
    file permissions (setpriv drops CAP_DAC_OVERRIDE)."""
    base = tmp_path / "readonly"
    base.mkdir()
    script = tmp_path / "train.py"
    script.write_text(EACCES_SCRIPT)
    cmd = [sys.executable, str(script), str(base / "ckpt")]
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("root overrides permissions, and setpriv(1) is not here to drop that")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"] + cmd
    os.chmod(base, 0o555)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop(ENV_ADDR, None)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    finally:
        os.chmod(base, 0o755)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained 3 writer False" in done.stdout, done.stdout
    warnings = _warnings(done.stderr)
    assert len(warnings) == 1 and "Permission denied" in warnings[0], done.stderr


@pytest.mark.slow
def test_a_job_on_a_full_checkpoint_directory_survives_a_rank_0_takeover(tmp_path):
    """The issue's case: every new rank 0 failed to take the lock over and exited, until
    every host was blacklisted. Now each warns once, the job finishes, and once space
    returns the writer takes the lock and writes."""
    with tmpfs(tmp_path / "mnt", "256k") as mnt:
        filler = fill(mnt)
        ckpt = mnt / "ckpt"
        job = Job(tmp_path / "run", ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1",
                                     "--checkpoint-dir", str(ckpt)],
                  env={"JOB_KILL_RANK0_AT": "10", "JOB_HOLD": "20",
                       "ELASTIC_CHECKPOINT_RETRY": "0.2"},
                  script=REPO / "tests" / "workloads" / "ckpt_train.py").start()
        job.wait_step(20)
        assert not store.list_checkpoints(str(ckpt))
        filler.unlink()
        job.wait_for(lambda: store.list_checkpoints(str(ckpt)), "a checkpoint once space is back")
        (job.out / "go").write_text("go")
        finals = job.assert_ok(job.finish(), epochs=6, samples=64, final_size=1)
        newest = store.load_newest(str(ckpt))
    out = job.output()
    # Only the rank 0 that killed itself is blacklisted, never the one that took over.
    assert len([x for x in out.splitlines() if "blacklisting host" in x]) == 1, out[-4000:]
    assert len([x for x in out.splitlines() if "taking the directory lock" in x]) == 2, out[-4000:]
    assert "Traceback" not in out
    assert newest[1]["objects"]["step"] == ("value", finals[0]["step"])
