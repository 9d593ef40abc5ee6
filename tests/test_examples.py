"""The training examples run here with no downloads, alone and under elasticrun."""

import re
import subprocess
import sys

import pytest
from support.jobs import REPO


def _run(args, tmp_path, timeout=240):
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})


@pytest.mark.slow
def test_cnn_example_learns_and_resumes_from_its_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _run([sys.executable, "examples/train_cnn.py", "--epochs", "2",
                  "--checkpoint-dir", str(ckpt)], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    accuracy = float(first.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1])
    assert accuracy > 0.5, first.stdout          # four classes: chance is 0.25
    assert list(ckpt.glob("ckpt-*.json"))
    again = _run([sys.executable, "examples/train_cnn.py", "--epochs", "3",
                  "--checkpoint-dir", str(ckpt)], tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from checkpoint" in again.stderr + again.stdout
    assert "epoch 0:" not in again.stdout and "epoch 2:" in again.stdout


@pytest.mark.slow
def test_cnn_example_under_elasticrun(tmp_path):
    run = _run([sys.executable, "-m", "elastic.runner", "-np", "2", "-H",
                "localhost:1,127.0.0.1:1", sys.executable, "examples/train_cnn.py",
                "--epochs", "1"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "epoch 0: 2 workers" in run.stdout


@pytest.mark.slow
def test_ddp_example_from_the_torchrun_page_trains_under_elasticrun(tmp_path):
    run = _run([sys.executable, "-m", "elastic.runner", "-np", "2", "-H",
                "localhost:1,127.0.0.1:1", sys.executable, "examples/train_ddp.py"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(line.rsplit(" ", 1)[1]) for line in run.stdout.splitlines()
              if ": 2 workers, loss " in line]
    assert len(losses) == 3 and losses[-1] < losses[0] / 4, run.stdout


def test_the_torchrun_page_diff_is_what_the_ddp_example_changes():
    """docs/torchrun.md's diff and examples/train_ddp.py, its "after" side, agree: every
    elastic call the diff adds is in the example, and no torch.distributed set-up it
    removes is left there."""
    page = (REPO / "docs" / "torchrun.md").read_text()
    diff = re.search(r"```diff\n(.*?)```", page, re.S).group(1).splitlines()
    example = (REPO / "examples" / "train_ddp.py").read_text()
    added = {name for line in diff if line.startswith("+")
             for name in re.findall(r"\b(?:elastic|state)(?:\.\w+)+", line)}
    removed_call = r"(?<![\w.])(?:dist\.\w+|DDP|DistributedSampler)\("
    removed = {call for line in diff if line.startswith("-")
               for call in re.findall(removed_call, line)}
    assert {"elastic.init", "elastic.DDP", "elastic.run", "state.commit"} <= added
    assert {"dist.init_process_group(", "DDP(", "DistributedSampler("} <= removed
    assert sorted(name for name in added if name not in example) == []
    assert sorted(set(re.findall(removed_call, example)) & removed) == []
