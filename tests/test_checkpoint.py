"""Durable checkpoints: the on-disk format, the Checkpointer, and real jobs that die.

Unit tests run standalone (size 1) in this process. The jobs run
tests/workloads/ckpt_train.py under elasticrun --checkpoint-dir, SIGKILL the
driver, corrupt files and share a directory between two jobs.
"""

import json
import os
import re
import signal
import sys
import time

import pytest
import torch
from filelock import FileLock

import elastic
from elastic.checkpoint import format as store
from elastic.checkpoint import writer as checkpoint_write
from elastic.checkpoint.checkpointer import Checkpointer, resolve
from elastic.checkpoint.writer import write_checkpoint
from elastic.protocol import ENV_ADDR
from elastic.state.states import TorchState
from elastic.worker import runtime

sys.path.insert(0, os.path.dirname(__file__))
from support.ckpt_jobs import ckpt_job, small_training, train_step  # noqa: E402
from support.jobs import wait_unlocked  # noqa: E402

STEPS = 6 * 64 // 8          # ckpt_train.py's defaults at world size 2
TEMP_MANIFEST = re.compile(r"^ckpt-\d{12}\.json\.\d+\.tmp$")


@pytest.fixture(autouse=True)
def standalone(monkeypatch):
    monkeypatch.delenv(ENV_ADDR, raising=False)
    monkeypatch.delenv("ELASTIC_CHECKPOINT_DIR", raising=False)
    runtime.shutdown()
    yield
    runtime.shutdown()


def _bytes(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def assert_tree_bitwise(a, b, path="root"):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, path
        assert _bytes(a) == _bytes(b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), path
        for k in a:
            assert_tree_bitwise(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_bitwise(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(200, 100, generator=g),                  # 80 KB: a blob of its own
            torch.randn(300, generator=g).to(torch.bfloat16),    # small ones share a pack
            torch.arange(7, dtype=torch.int64), torch.tensor(3.5),
            torch.tensor([True, False, True]), torch.empty(0, 4),
            torch.randn(40_000, generator=g, dtype=torch.float64)]   # 320 KB


def _write(directory, version, tensors, skeleton=None):
    skeleton = skeleton if skeleton is not None else {"v": version, "n": len(tensors)}
    return write_checkpoint(str(directory), version, skeleton, tensors)


def _load_version(directory, version):
    body = store.read_manifest(store.manifest_path(str(directory), version))
    return store.read_checkpoint(str(directory), body)


# -- the on-disk format ------------------------------------------------------------------------
def test_round_trip_is_bitwise_for_every_dtype_and_shape(tmp_path):
    from elastic.state.snapshot import split
    tree = {"a": _tensors(), "b": {"c": torch.zeros(3), "d": torch.zeros(3)},
            "objects": ("x", [1, {"y": None}], 2.5)}
    skeleton, tensors = split(tree)
    _write(tmp_path, 5, tensors, skeleton)
    back = _load_version(tmp_path, 5)
    assert_tree_bitwise(tree, back)
    back["b"]["c"].add_(1)      # equal tensors share a blob, never storage
    assert float(back["b"]["d"].sum()) == 0
    version, newest, path = store.load_newest(str(tmp_path))
    assert version == 5 and path.endswith("ckpt-000000000005.json")
    assert_tree_bitwise(tree, newest)
    assert elastic.checkpoint.load(tmp_path)[0] == 5


def test_unchanged_tensors_are_not_written_again(tmp_path):
    tensors = _tensors()
    first = _write(tmp_path, 1, tensors)
    assert first["bytes_written"] >= first["bytes_total"]
    tensors[0].add_(1)                                  # one 80 KB tensor changes
    second = _write(tmp_path, 2, tensors)
    big = tensors[0].numel() * 4
    small_pack = sum(t.numel() * t.element_size() for t in tensors[1:6]) + 6 * store.ALIGN
    assert big <= second["bytes_written"] <= big + small_pack + 1024, second
    m1 = store.read_manifest(store.manifest_path(str(tmp_path), 1))
    m2 = store.read_manifest(store.manifest_path(str(tmp_path), 2))
    assert m2["tensors"][6]["blob"] == m1["tensors"][6]["blob"]      # referenced, not rewritten
    assert m2["tensors"][0]["blob"] != m1["tensors"][0]["blob"]
    assert _write(tmp_path, 3, tensors)["bytes_written"] < 1024     # only the skeleton


@pytest.mark.parametrize("damage", ["truncate manifest", "edit manifest", "flip blob byte",
                                    "delete blob", "truncate blob"])
def test_corrupt_newest_is_detected_and_the_previous_one_used(tmp_path, damage):
    tensors = _tensors()
    _write(tmp_path, 1, tensors)
    tensors[6].mul_(2)
    _write(tmp_path, 2, tensors)
    m1 = store.read_manifest(store.manifest_path(str(tmp_path), 1))
    m2 = store.read_manifest(store.manifest_path(str(tmp_path), 2))
    only_new = store.blob_path(str(tmp_path), m2["tensors"][6]["blob"])
    assert m2["tensors"][6]["blob"] not in m1["blobs"]
    path2 = store.manifest_path(str(tmp_path), 2)
    if damage == "truncate manifest":
        os.truncate(path2, os.path.getsize(path2) // 2)
    elif damage == "edit manifest":
        text = open(path2).read().replace('"version": 2', '"version": 3')
        open(path2, "w").write(text)
    elif damage == "flip blob byte":
        with open(only_new, "r+b") as f:
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "delete blob":
        os.unlink(only_new)
    else:
        os.truncate(only_new, 100)
    warnings = []
    version, tree, path = store.load_newest(str(tmp_path), warn=warnings.append, quarantine=True)
    assert version == 1 and path == store.manifest_path(str(tmp_path), 1)
    if damage == "delete blob":
        # Missing is an OSError, not a checksum mismatch: skipped, nothing renamed.
        assert len(warnings) == 1 and "skipped for this load, nothing renamed" in warnings[0]
        assert [v for v, _ in store.list_checkpoints(str(tmp_path))] == [1, 2]
        assert not [n for n in os.listdir(tmp_path / "blobs") if n.endswith(".corrupt")]
        _write(tmp_path, 2, tensors)
        assert store.load_newest(str(tmp_path), warn=warnings.append)[0] == 2
        assert len(warnings) == 1
        return
    assert len(warnings) == 1 and "ckpt-000000000002.json is corrupt" in warnings[0], warnings
    # Quarantined: a later load does not warn again, and a later write of the same
    # content does not trust the bad blob.
    assert [v for v, _ in store.list_checkpoints(str(tmp_path))] == [1]
    _write(tmp_path, 2, tensors)
    assert store.load_newest(str(tmp_path), warn=warnings.append)[0] == 2
    assert len(warnings) == 1


def test_a_failed_write_leaves_nothing_visible(tmp_path, monkeypatch):
    _write(tmp_path, 1, _tensors())
    real_replace = os.replace

    def replace(src, dst):
        if dst.endswith(".json"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint_write.os, "replace", replace)
    tensors = _tensors(seed=1)
    with pytest.raises(OSError):
        _write(tmp_path, 2, tensors)
    monkeypatch.undo()
    assert [v for v, _ in store.list_checkpoints(str(tmp_path))] == [1]
    names = os.listdir(tmp_path) + os.listdir(tmp_path / "blobs")
    assert not [n for n in names if n.endswith(".tmp")], names
    assert store.load_newest(str(tmp_path))[0] == 1


def test_prune_keeps_the_newest_k_and_every_blob_they_reference(tmp_path):
    tensors = _tensors()          # tensors[6] never changes below
    for version in range(1, 6):
        tensors[0].add_(1)
        _write(tmp_path, version, tensors)
        store.prune(str(tmp_path), keep=2)
    assert [v for v, _ in store.list_checkpoints(str(tmp_path))] == [4, 5]
    kept = set()
    for version in (4, 5):
        body = store.read_manifest(store.manifest_path(str(tmp_path), version))
        kept |= set(body["blobs"])
        _load_version(tmp_path, version)         # every blob is there and verifies
    assert set(os.listdir(tmp_path / "blobs")) == kept
    # The unchanged tensor was written at version 1 and is still referenced by 4 and 5.
    m5 = store.read_manifest(store.manifest_path(str(tmp_path), 5))
    assert os.path.exists(store.blob_path(str(tmp_path), m5["tensors"][6]["blob"]))


# -- the Checkpointer ---------------------------------------------------------------------------


def test_a_new_state_resumes_from_the_newest_checkpoint(tmp_path):
    model, optimizer, sampler = small_training()
    ck = Checkpointer(tmp_path / "ck", every_commits=3, keep=2)
    state = TorchState(model, optimizer, elastic_checkpoint=ck, sampler=sampler, epoch=0, batch=0)
    state.sync()
    for i in range(8):
        train_step(model, optimizer, sampler, i)
        state.batch += 1
        state.commit()
        assert ck.wait(60)                   # deterministic versions: no deferral
    ck.close()                               # writes the last commit (8) as well
    assert ck.stats["checkpoints"] == 3 and ck.stats["failures"] == 0
    assert [v for v, _ in store.list_checkpoints(str(tmp_path / "ck"))] == [6, 8]
    expected = state.capture()

    model2, optimizer2, sampler2 = small_training(seed=99)
    ck2 = Checkpointer(tmp_path / "ck")
    state2 = TorchState(model2, optimizer2, elastic_checkpoint=ck2, sampler=sampler2, epoch=0, batch=0)
    state2.sync()
    assert state2.commit_version == 8 and ck2.resumed_from["version"] == 8
    assert state2.batch == 8
    assert_tree_bitwise(expected, state2.capture())
    ck2.close()


def test_a_commit_never_waits_for_the_writer_nor_overwrites_what_it_reads(tmp_path):
    model, optimizer, sampler = small_training(width=256)      # 256 KB weights: blobs of their own
    ck = Checkpointer(tmp_path, every_commits=1)
    ck.test_hold_s = 1.0                      # the writer reads the big buffers only after 1 s
    state = TorchState(model, optimizer, elastic_checkpoint=ck, sampler=sampler, step=0)
    state.sync()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    state.commit()                          # version 1, handed to the writer
    with torch.no_grad():
        model[0].weight.fill_(2.0)
    began = time.monotonic()
    state.commit()                          # version 2: into spare buffers, no waiting
    assert time.monotonic() - began < 0.5
    assert ck.stats["swapped_commits"] == 1 and ck.stats["deferred"] == 1
    assert float(state.snapshot.materialize()["model"]["0.weight"].mean()) == 2.0
    assert ck.wait(30)
    ck.test_hold_s = 0.0
    with torch.no_grad():
        model[0].weight.fill_(3.0)
    state.commit()                          # version 3: reuses the spares, no allocation
    assert ck.wait(30)
    state.commit()                          # version 4
    ck.close(final=False)
    assert float(_load_version(tmp_path, 1)["model"]["0.weight"].mean()) == 1.0
    assert float(_load_version(tmp_path, 3)["model"]["0.weight"].mean()) == 3.0
    assert float(_load_version(tmp_path, 4)["model"]["0.weight"].mean()) == 3.0
    assert ck.stats["swapped_commits"] == 1


def test_half_the_parameters_frozen_writes_about_half_the_bytes(tmp_path):
    written = {}
    for frozen in (False, True):
        model, optimizer, sampler = small_training(freeze_first=frozen, width=256)
        ck = Checkpointer(tmp_path / str(frozen), every_commits=1)
        state = TorchState(model, optimizer, elastic_checkpoint=ck, sampler=sampler, step=0)
        state.sync()
        per_checkpoint = []
        for i in range(4):
            train_step(model, optimizer, sampler, i, width=256)
            state.commit()
            assert ck.wait(60)
            per_checkpoint.append(ck.stats["last"]["bytes_written"])
        ck.close(final=False)
        written[frozen] = per_checkpoint
    full, half = sum(written[False][1:]), sum(written[True][1:])
    ratio = half / full
    print(f"incremental bytes per checkpoint: all trainable {written[False]}, "
          f"first layer frozen {written[True]}, ratio {ratio:.3f}")
    assert 0.45 <= ratio <= 0.55, written


def test_a_directory_held_by_another_job_stops_with_one_line(tmp_path):
    other = FileLock(os.path.join(tmp_path, "LOCK"))        # another job's writer
    other.acquire()
    (tmp_path / "LOCK.owner").write_text(json.dumps({"job": "other", "host": "h", "pid": 1}))
    model, optimizer, _ = small_training()
    ck = Checkpointer(tmp_path)
    ck.lock_wait_s = 0.3
    state = TorchState(model, optimizer, elastic_checkpoint=ck)
    began = time.monotonic()
    with pytest.raises(SystemExit) as info:
        state.sync()
    assert time.monotonic() - began >= 0.3
    assert str(info.value) == f"elastic: checkpoint directory {tmp_path} is in use by another job"
    other.release()
    state.sync()                                            # free again
    assert ck.is_writer
    # A second Checkpointer on the same directory in this process is a bug: said at once.
    with pytest.raises(elastic.checkpoint.CheckpointError, match="of this process"):
        TorchState(model, optimizer, elastic_checkpoint=Checkpointer(tmp_path)).sync()
    ck.close()


def test_arguments_and_the_environment_default(tmp_path, monkeypatch):
    with pytest.raises(ValueError):
        Checkpointer(tmp_path, every_commits=0)
    with pytest.raises(ValueError):
        Checkpointer(tmp_path, every_seconds=-1)
    with pytest.raises(ValueError):
        Checkpointer(tmp_path, keep=0)
    ck = Checkpointer(tmp_path)
    assert (ck.every_commits, ck.every_seconds, ck.keep) == (10, 60.0, 3)
    assert Checkpointer(tmp_path, every_seconds=5).every_commits is None
    assert resolve(None) is None and TorchState().checkpointer is None
    monkeypatch.setenv("ELASTIC_CHECKPOINT_DIR", str(tmp_path / "env"))
    assert TorchState().checkpointer.directory == str(tmp_path / "env")
    assert TorchState(elastic_checkpoint=False).checkpointer is None
    assert TorchState(elastic_checkpoint=ck).checkpointer is ck
    with pytest.raises(TypeError):
        TorchState(elastic_checkpoint=3)
    # checkpoint= is the user's own name (a Horovod script may use it) ...
    mine = TorchState(checkpoint=False)
    assert mine.checkpoint is False and mine.checkpointer.directory == str(tmp_path / "env")
    # ... except that a Checkpointer there is still taken as the option, with a warning.
    with pytest.warns(DeprecationWarning, match="elastic_checkpoint"):
        assert TorchState(checkpoint=ck).checkpointer is ck
    assert elastic.Checkpointer is Checkpointer


# -- real jobs ----------------------------------------------------------------------------------


def _kill_driver(job):
    os.kill(job.proc.pid, signal.SIGKILL)
    assert job.finish() == -signal.SIGKILL


def _resumed_version(job):
    found = re.findall(r"resumed from checkpoint \S+ckpt-(\d+)\.json \(commit (\d+)\)",
                       job.output())
    assert len(found) == 1, job.output()[-3000:]
    return int(found[0][1])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Final parameters of the same job run without a break (and without checkpoints)."""
    job = ckpt_job(tmp_path_factory.mktemp("baseline"), 2)
    finals = job.assert_ok(job.run(), epochs=6, samples=64, final_size=2)
    return finals[0]


@pytest.mark.slow
def test_sigkill_of_the_driver_then_rerun_resumes_bitwise(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    first = ckpt_job(tmp_path / "run1", 2, ckpt, env={"JOB_STEP_SLEEP": "0.05"}).start()
    first.wait_for(lambda: store.list_checkpoints(str(ckpt)), "a checkpoint")
    _kill_driver(first)
    assert not first.finals(), "the job ended before the kill"
    wait_unlocked(ckpt)
    rerun = ckpt_job(tmp_path / "run2", 2, ckpt, env={"JOB_STEP_SLEEP": "0.05"})
    finals = rerun.assert_ok(rerun.run(), epochs=6, samples=64, final_size=2)
    version = _resumed_version(rerun)
    assert finals[0]["resumed_from"]["version"] == version and 0 < version
    assert finals[0]["step"] == STEPS
    assert min(r["step"] for r in rerun.steps()) > 1       # it did not start over
    assert finals[0]["params"] == uninterrupted["params"]
    assert finals[0]["optimizer"] == uninterrupted["optimizer"]


@pytest.mark.slow
def test_corrupt_newest_checkpoint_falls_back_to_the_previous_at_another_size(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = ckpt_job(tmp_path / "run1", 2, ckpt)
    first.assert_ok(first.run(), epochs=6, samples=64, final_size=2)
    (v_prev, _), (v_new, newest) = store.list_checkpoints(str(ckpt))[-2:]
    body = store.read_manifest(newest)
    older = store.read_manifest(store.manifest_path(str(ckpt), v_prev))
    unique = sorted(set(body["blobs"]) - set(older["blobs"]))
    assert unique
    path = store.blob_path(str(ckpt), unique[0])
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    rerun = ckpt_job(tmp_path / "run2", 1, ckpt)
    finals = rerun.assert_ok(rerun.run(), epochs=6, samples=64, final_size=1)
    out = rerun.output()
    assert f"ckpt-{v_new:012d}.json is corrupt" in out and "warning" in out, out[-3000:]
    assert _resumed_version(rerun) == v_prev
    assert finals[0]["step"] > 0


@pytest.mark.slow
def test_a_second_job_on_the_same_directory_gets_one_clear_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = ckpt_job(tmp_path / "run1", 2, ckpt, env={"JOB_HOLD": "3"}).start()
    first.wait_step(3)
    second = ckpt_job(tmp_path / "run2", 1, ckpt, env={"ELASTIC_CHECKPOINT_LOCK_WAIT": "1"})
    code = second.run()
    out = second.output()
    line = f"elastic: checkpoint directory {ckpt} is in use by another job"
    assert code != 0
    # One line from the worker; the driver's root-cause block quotes it once more.
    assert len([x for x in out.splitlines() if "<stderr>:" in x and x.endswith(line)]) == 1, out
    assert "root cause:" in out, out
    assert "Traceback" not in out, out
    assert not second.steps()                   # it never trained
    (first.out / "go").write_text("go")
    first.assert_ok(first.finish(), epochs=6, samples=64, final_size=2)


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_never_loads_a_partial_one(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    first = ckpt_job(tmp_path / "run1", 2, ckpt,
                     env={"JOB_HOLD": "2", "ELASTIC_CHECKPOINT_TEST_DELAY": "1"}).start()
    first.wait_for(lambda: store.list_checkpoints(str(ckpt)) and any(
        TEMP_MANIFEST.match(n) for n in os.listdir(ckpt)), "a manifest being written")
    _kill_driver(first)
    wait_unlocked(ckpt)
    temps = [n for n in os.listdir(ckpt) + os.listdir(ckpt / "blobs") if n.endswith(".tmp")]
    assert temps, "the kill should have cut a write short"
    visible = store.list_checkpoints(str(ckpt))
    for _version, path in visible:             # whatever is visible is complete
        store.read_checkpoint(str(ckpt), store.read_manifest(path))
    rerun = ckpt_job(tmp_path / "run2", 2, ckpt)
    finals = rerun.assert_ok(rerun.run(), epochs=6, samples=64, final_size=2)
    assert _resumed_version(rerun) == visible[-1][0]
    assert "corrupt" not in rerun.output()
    assert finals[0]["params"] == uninterrupted["params"]
    left = os.listdir(ckpt) + os.listdir(ckpt / "blobs")
    assert not [n for n in left if n.endswith(".tmp")], left     # the new writer cleaned up


@pytest.mark.slow
def test_when_rank_0_dies_the_next_rank_0_takes_over_the_writing(tmp_path):
    ckpt = tmp_path / "ckpt"
    job = ckpt_job(tmp_path / "run", 2, ckpt, env={"JOB_KILL_RANK0_AT": "15"},
                   hosts="localhost:1,127.0.0.1:1")
    job.args[:0] = ["--min-np", "1"]
    finals = job.assert_ok(job.run(), epochs=6, samples=64, final_size=1)
    assert "blacklisting host localhost" in job.output()
    assert "resumed from checkpoint" not in job.output()     # the survivor kept its state
    owner = json.loads((ckpt / "LOCK.owner").read_text())
    assert owner["pid"] == finals[0]["pid"]                  # the new rank 0 holds the lock
    kept = store.list_checkpoints(str(ckpt))
    assert len(kept) == 3 and kept[-1][0] > 15
    for _version, path in kept:                              # written after the change
        assert store.read_manifest(path)["world_size"] == 1
    assert store.load_newest(str(ckpt))[1]["objects"]["step"] == ("value", finals[0]["step"])


# -- format 1 (sha256-named blobs) still loads ------------------------------------------------
FORMAT1 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ckpt_format1")


def test_format1_checkpoint_written_by_the_sha256_writer_still_loads():
    from elastic.checkpoint import load
    version, tree = load(FORMAT1)
    assert version == 5
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    for k, v in model.state_dict().items():
        assert torch.equal(tree["model"][k], v), k
    assert torch.equal(tree["objects"]["big"][1], torch.arange(20000, dtype=torch.float32))
    assert tree["objects"]["epoch"] == ("value", 3)


def test_format1_blobs_are_still_checked_by_sha256(tmp_path):
    import shutil

    from elastic.checkpoint import format as fmt
    copy = tmp_path / "ckpt"
    shutil.copytree(FORMAT1, copy)
    big = max((copy / "blobs").iterdir(), key=lambda p: p.stat().st_size)
    assert len(big.name) == 64
    data = bytearray(big.read_bytes())
    data[100] ^= 1
    big.write_bytes(bytes(data))
    assert fmt.load_newest(str(copy)) is None


def test_new_blobs_are_named_by_xxh3_128(tmp_path):
    import xxhash

    from elastic.checkpoint import format as fmt
    from elastic.checkpoint.writer import write_checkpoint
    from elastic.state.snapshot import split
    skeleton, tensors = split({"w": torch.arange(50000, dtype=torch.float32)})
    write_checkpoint(str(tmp_path), 1, skeleton, tensors)
    body = fmt.read_manifest(fmt.manifest_path(str(tmp_path), 1))
    assert body["format"] == fmt.FORMAT
    name = body["tensors"][0]["blob"]
    assert name == xxhash.xxh3_128_hexdigest(tensors[0].numpy().tobytes())
