"""Root-cause errors and the console's shape (issue 30, part 3).

One real two-worker job: the training command carries prefixes of our flags,
rank 1 raises, and the console is asked for timestamps and rank 1's output
only. Then elastic.launch with a function that raises, and the console's
fallback to the stderr tail when a worker leaves no error file (SIGKILL).
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.jobs import DEADLINE_S, ELASTICRUN, REPO

import elastic
from elastic.protocol import Member
from elastic.runner.console import Console

SCRIPT = REPO / "tests" / "workloads" / "raises_on_rank1.py"
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


@pytest.fixture(scope="module")
def failed_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("root_cause")
    logs = tmp / "logs"
    started = time.time()
    run = subprocess.run(
        ELASTICRUN + ["-np", "2", "-H", "localhost:2", "--output-filename", str(logs),
                      "--timestamp-output", "--output-ranks", "1",
                      sys.executable, str(SCRIPT), "--n", "3", "--min", "1", "-v"],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=DEADLINE_S,
        start_new_session=True)
    return {"code": run.returncode, "text": run.stdout.decode(errors="replace"), "logs": logs,
            "started": started}


def test_the_job_fails_with_the_reason_last(failed_job):
    assert failed_job["code"] == 1
    last = failed_job["text"].rstrip("\n").splitlines()[-1]
    assert last.startswith("elasticrun: error: "), failed_job["text"][-2000:]


def test_the_root_cause_block_names_the_worker_rank_host_and_traceback(failed_job):
    text = failed_job["text"]
    header = re.search(rf"^elasticrun: {STAMP} root cause: worker (\S+) \(rank 1\) on localhost "
                       rf"failed at {STAMP}: worker (\S+) on localhost exited with code 1$",
                       text, re.M)
    assert header and header.group(1) == header.group(2), text[-3000:]
    block = text[header.end():].splitlines()[1:]
    wid = header.group(1)
    error_file = failed_job["logs"] / f"worker.{wid}" / "error.json"
    assert block[0] == f"elasticrun:   error file: {error_file}"
    assert block[1] == "elasticrun:   traceback (from its error file):"
    body = [line for line in block if line.startswith("elasticrun:     ")]
    assert "in load_batch" in "\n".join(body)
    assert body[-1] == "elasticrun:     ValueError: boom on rank 1"
    # the block comes right before the one error line
    assert block[len(body) + 2].startswith("elasticrun: error: ")


def test_the_error_file_holds_rank_host_worker_time_and_traceback(failed_job):
    files = list(failed_job["logs"].glob("worker.*/error.json"))
    assert len(files) == 1
    record = json.loads(files[0].read_text())
    assert record["rank"] == 1 and record["host"] == "localhost"
    assert files[0].parent.name == f"worker.{record['worker']}"
    assert failed_job["started"] <= record["time"] <= time.time()
    assert record["type"] == "ValueError" and record["message"] == "boom on rank 1"
    assert record["traceback"].rstrip().endswith("ValueError: boom on rank 1")


def test_driver_lines_carry_timestamps(failed_job):
    lines = [line for line in failed_job["text"].splitlines() if line.startswith("elasticrun: ")
             and not line.startswith(("elasticrun: error:", "elasticrun:   "))]
    assert len(lines) >= 3
    for line in lines:
        assert re.match(rf"^elasticrun: {STAMP} ", line), line


def test_the_command_keeps_its_arguments_and_output_shows_only_rank_1(failed_job):
    text = failed_job["text"]
    shown = re.findall(rf"^{STAMP} \[(\S+)\]<stdout>:(.*)$", text, re.M)
    assert [line for _, line in shown] == ["argv=['--n', '3', '--min', '1', '-v'] rank 1"], text
    assert "rank 0" not in text
    # the files keep every rank's output
    kept = [p.read_text() for p in failed_job["logs"].glob("worker.*/stdout")]
    assert sorted(kept) == [f"argv=['--n', '3', '--min', '1', '-v'] rank {r}\n" for r in (0, 1)]


def _raise_on_rank_1():
    elastic.init()
    if elastic.rank() == 1:
        raise KeyError("no such shard")
    time.sleep(60)


def test_launch_error_carries_the_root_cause(tmp_path):
    started = time.time()
    with pytest.raises(elastic.LaunchError) as info:
        elastic.launch(_raise_on_rank_1, np=2, quiet=True, workdir=str(tmp_path), timeout=240)
    err = info.value
    assert err.rank == 1 and err.host == "localhost" and err.worker is not None
    assert err.exc_type == "KeyError" and "no such shard" in err.remote_traceback
    assert started <= err.failed_at <= time.time()
    assert re.search(rf"root cause: worker {re.escape(str(err.worker))} \(rank 1\) on localhost",
                     err.root_cause[0]), err.root_cause
    assert err.root_cause[-1].endswith("KeyError: 'no such shard'"), err.root_cause


def test_without_an_error_file_the_root_cause_is_the_stderr_tail(tmp_path, capsys):
    console = Console(error_dir=str(tmp_path), quiet=True)
    console.set_ranks([Member("7", "node-2", 3, 4, 0, 1, 3, 4)])
    console.write_lines("7", "stderr", [f"line {i}" for i in range(30)])
    console.worker_failed("7", "node-2", "worker 7 on node-2 exited with code -9 (SIGKILL)")
    console.worker_failed("8", "node-3", "worker 8 on node-3 exited with code 1")
    lines = console.root_cause()
    assert re.match(rf"root cause \(first of 2 failures\): worker 7 \(rank 3\) on node-2 failed "
                    rf"at {STAMP}: worker 7 on node-2 exited with code -9 \(SIGKILL\)$", lines[0])
    assert lines[1:] == ["  last lines of its stderr:"] + [f"    line {i}" for i in range(20, 30)]


def test_the_error_file_is_written_only_where_its_directory_exists(tmp_path, monkeypatch):
    from elastic import protocol
    from elastic.worker import error_file
    monkeypatch.setenv(protocol.ENV_WORKER_ID, "5")
    try:
        raise RuntimeError("disk on fire")
    except RuntimeError as exc:
        caught = (type(exc), exc, exc.__traceback__)
    monkeypatch.setenv(protocol.ENV_ERROR_DIR, str(tmp_path / "not-on-this-host"))
    assert error_file.write(*caught) is None
    assert not (tmp_path / "not-on-this-host").exists()
    monkeypatch.setenv(protocol.ENV_ERROR_DIR, str(tmp_path))
    path = error_file.write(*caught)
    assert path == str(tmp_path / "worker.5" / "error.json")
    record = json.loads(Path(path).read_text())
    assert record["worker"] == "5" and record["type"] == "RuntimeError"
    assert record["traceback"].rstrip().endswith("RuntimeError: disk on fire")
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
