"""Checkpoints that verify but cannot be used here are never buried (issue 26, part 4).

A newer format, objects that no longer unpickle, another model: the rerun falls back to
the newest checkpoint that loads with one warning naming both (or refuses with one line,
``--on-unusable-checkpoint stop``), never starts from scratch while checkpoints exist,
renames nothing, and writes every later checkpoint above every version on disk. A model
that does not fit stops the job with one line, and no host is blamed.

Unit tests run standalone (size 1) in this process; one job runs under elasticrun.
"""

import json
import os
import pickle
import sys
import types

import pytest
from support.ckpt_jobs import ckpt_job, small_training, train_step

from elastic.checkpoint import format as store
from elastic.checkpoint.checkpointer import Checkpointer
from elastic.checkpoint.errors import NewerFormat, Unusable
from elastic.checkpoint.writer import write_checkpoint
from elastic.protocol import ENV_ADDR, EXIT_STOP_JOB
from elastic.state.states import TorchState
from elastic.worker import runtime


@pytest.fixture(autouse=True)
def standalone(monkeypatch):
    monkeypatch.delenv(ENV_ADDR, raising=False)
    monkeypatch.delenv("ELASTIC_CHECKPOINT_DIR", raising=False)
    monkeypatch.delenv("ELASTIC_CHECKPOINT_UNUSABLE", raising=False)
    runtime.shutdown()
    yield
    runtime.shutdown()


def _train(directory, commits=6):
    """A state that commits ``commits`` times with a checkpoint at every third commit."""
    model, optimizer, sampler = small_training()
    ck = Checkpointer(directory, every_commits=3, keep=5)
    state = TorchState(model, optimizer, elastic_checkpoint=ck, sampler=sampler, batch=0)
    state.sync()
    for i in range(commits):
        train_step(model, optimizer, sampler, i)
        state.batch += 1
        state.commit()
        assert ck.wait(60)
    ck.close(final=False)
    return state


def _rewrite_body(path, **changes):
    """Change a manifest's body and seal it again: intact, as a newer writer would leave it."""
    body = json.loads(open(path).read())["body"]
    body.update(changes)
    with open(path, "wb") as f:
        f.write(store.encode_manifest(body))


def _unpicklable_newest(directory, version):
    """A checkpoint ``version`` whose skeleton names a class that no longer exists (a
    renamed class, a module gone with a library upgrade)."""
    module = types.ModuleType("gone_module")

    class Gone:
        pass
    Gone.__module__, Gone.__qualname__ = "gone_module", "Gone"
    module.Gone = Gone
    sys.modules["gone_module"] = module
    try:
        skeleton = pickle.dumps({"objects": Gone()})
    finally:
        del sys.modules["gone_module"]
    write_checkpoint(str(directory), version, {"x": 1}, [])
    manifest = store.manifest_path(str(directory), version)
    body = json.loads(open(manifest).read())["body"]
    name = store.content_name(skeleton)
    with open(store.blob_path(str(directory), name), "wb") as f:
        f.write(skeleton)
    body["blobs"] = {name: len(skeleton)}
    body["skeleton"] = name
    with open(manifest, "wb") as f:
        f.write(store.encode_manifest(body))


def _resume(directory, unusable=None, width=16):
    model, optimizer, sampler = small_training(seed=99, width=width)
    ck = Checkpointer(directory, unusable=unusable)
    state = TorchState(model, optimizer, elastic_checkpoint=ck, sampler=sampler, batch=0)
    state.sync()
    return state, ck


def _corrupt_files(directory):
    return [n for root, _, names in os.walk(directory) for n in names if n.endswith(".corrupt")]


def test_a_newer_format_is_refused_as_newer_not_quarantined_and_the_previous_one_loads(
        tmp_path, capsys):
    _train(tmp_path / "ck")
    newest = store.manifest_path(str(tmp_path / "ck"), 6)
    _rewrite_body(newest, format="elastic-checkpoint/9")
    with pytest.raises(NewerFormat, match="written in format 'elastic-checkpoint/9' by a newer"):
        store.read_manifest(newest)
    state, ck = _resume(tmp_path / "ck")
    err = capsys.readouterr().err
    assert ck.resumed_from["version"] == 3 and state.batch == 3
    assert err.count("warning") == 1, err
    assert f"checkpoint {newest} cannot be used (written in format 'elastic-checkpoint/9'" in err
    assert "resumed from " + store.manifest_path(str(tmp_path / "ck"), 3) in err
    assert not _corrupt_files(tmp_path / "ck") and os.path.exists(newest)
    # Every later write lands above the unusable one: it is never buried.
    assert state.commit_version == 6
    state.commit()
    ck.close()
    assert [v for v, _ in store.list_checkpoints(str(tmp_path / "ck"))][-1] == 7
    assert store.load_newest(str(tmp_path / "ck"))[0] == 7


def test_objects_that_no_longer_unpickle_fall_back_with_one_warning(tmp_path, capsys):
    _train(tmp_path / "ck")
    _unpicklable_newest(tmp_path / "ck", 9)
    with pytest.raises(Unusable, match="do not unpickle here .ModuleNotFoundError"):
        store.read_checkpoint(str(tmp_path / "ck"), store.read_manifest(
            store.manifest_path(str(tmp_path / "ck"), 9)))
    state, ck = _resume(tmp_path / "ck")
    err = capsys.readouterr().err
    assert ck.resumed_from["version"] == 6 and state.batch == 6 and state.commit_version == 9
    assert err.count("warning") == 1 and "ckpt-000000000009.json cannot be used" in err, err
    assert not _corrupt_files(tmp_path / "ck")
    ck.close(final=False)


def test_stop_refuses_with_one_line_and_no_host_to_blame(tmp_path, capsys):
    _train(tmp_path / "ck")
    _unpicklable_newest(tmp_path / "ck", 9)
    with pytest.raises(SystemExit) as exit_:
        _resume(tmp_path / "ck", unusable="stop")
    assert exit_.value.code == EXIT_STOP_JOB
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic: error: checkpoint ") and \
        lines[0].endswith("not resuming from an older one (--on-unusable-checkpoint stop)"), lines


def test_another_model_never_starts_from_scratch(tmp_path, capsys):
    _train(tmp_path / "ck")
    with pytest.raises(SystemExit) as exit_:
        _resume(tmp_path / "ck", width=8)
    assert exit_.value.code == EXIT_STOP_JOB
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"elastic: error: no checkpoint in {tmp_path / 'ck'} can be used (the newest, "), lines
    assert "it does not fit this state: RuntimeError: Error(s) in loading state_dict" in lines[0]
    assert "refusing to start from scratch" in lines[0]


@pytest.mark.slow
def test_a_job_of_another_model_stops_with_one_line_and_blames_no_host(tmp_path):
    ckpt = tmp_path / "ck"
    first = ckpt_job(tmp_path / "a", 2, ckpt, env={"JOB_EPOCHS": "1"})
    assert first.run() == 0, first.output()[-3000:]
    assert store.list_checkpoints(str(ckpt))
    job = ckpt_job(tmp_path / "b", 2, ckpt, env={"JOB_EPOCHS": "1", "JOB_WIDTH": "16"})
    code = job.run()
    out = job.output()
    assert code == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"elasticrun: error: no checkpoint in {ckpt} can be used"), out[-3000:]
    assert "size mismatch" in last and "blacklisting" not in out and "Traceback" not in out


def test_a_bad_choice_in_the_drivers_environment_is_one_usage_line(monkeypatch):
    """Workers inherit ELASTIC_CHECKPOINT_UNUSABLE: elasticrun refuses a bad one at start
    (one line, exit 2), not with a traceback on every worker and a blacklisted host each."""
    from elastic.runner import cli
    monkeypatch.setenv("ELASTIC_CHECKPOINT_UNUSABLE", "bogus")
    with pytest.raises(cli.UsageError, match=r"ELASTIC_CHECKPOINT_UNUSABLE\) must be one of "
                                             r"previous, stop, got 'bogus'"):
        cli.config_from_args(cli.parse(["-np", "1", "true"]))
    monkeypatch.setenv("ELASTIC_CHECKPOINT_UNUSABLE", "stop")
    assert cli.config_from_args(cli.parse(["-np", "1", "true"])).np == 1
