"""elastic.launch: a Python function run as an elastic job, results back by rank.

The jobs here are real: elasticrun runs as a child process and starts worker
processes; localhost and 127.0.0.1 act as two hosts.
"""

import json
import os
import pickle
import signal
import time

import cloudpickle
import pytest

import elastic
from elastic.launching import client as launch_module
from elastic.launching.client import LaunchError, launch

TWO_HOSTS = "localhost:1,127.0.0.1:1"


def rank_times_ten():
    print(f"hello from rank {elastic.rank()}")
    return elastic.rank() * 10


def fail_on_rank_one():
    if elastic.rank() == 1:
        raise ValueError("rank 1 refuses")
    return "ok"


@pytest.mark.slow
def test_results_come_back_in_rank_order(capsys):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert launch(rank_times_ten, np=2, hosts=TWO_HOSTS) == [0, 10]
    # Notebook-safe: the caller's signal handlers are untouched, and the job's output
    # went through sys.stdout / sys.stderr (which pytest, like a notebook, replaces).
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    out, err = capsys.readouterr()
    assert "<stdout>:hello from rank 0" in out and "<stdout>:hello from rank 1" in out
    assert "job finished: 2 workers exited 0" in err


@pytest.mark.slow
def test_closure_and_arguments_travel_with_cloudpickle(capsys):
    offset = 7
    seen = []

    def add(x, scale=1):
        seen.append(x)            # a local object captured by value
        return {"rank": elastic.rank(), "value": (x + offset) * scale, "seen": list(seen)}

    results = launch(add, args=(5,), kwargs={"scale": 3}, quiet=True)
    assert results == [{"rank": 0, "value": 36, "seen": [5]}]
    assert seen == []             # the caller's copy was not touched
    assert capsys.readouterr() == ("", "")   # quiet: nothing passed through


@pytest.mark.slow
def test_exception_names_the_failing_worker(capsys):
    with pytest.raises(LaunchError) as info:
        # elastic_timeout bounds the rare case where rank 0 still builds its group
        # when rank 1 exits: it then waits for 2 slots that never come back.
        launch(fail_on_rank_one, np=2, hosts=TWO_HOSTS, quiet=True, elastic_timeout=20)
    err = info.value
    text = str(err)
    assert err.rank == 1 and err.host == "127.0.0.1" and err.worker is not None
    assert err.exc_type == "ValueError" and err.exc_message == "rank 1 refuses"
    assert text.startswith(f"worker {err.worker} on 127.0.0.1 failed: ValueError: rank 1 refuses")
    assert f"worker {err.worker} " in text and "exited with code 1" in text
    # The tail of that worker's stderr holds the traceback.
    assert "Traceback" in err.stderr_tail and "ValueError: rank 1 refuses" in err.stderr_tail
    assert "ValueError: rank 1 refuses" in err.remote_traceback
    assert capsys.readouterr() == ("", "")


@pytest.mark.slow
def test_timeout_stops_the_job():
    started = time.monotonic()
    with pytest.raises(LaunchError, match="timed out after 2 s"):
        launch(time.sleep, args=(300,), timeout=2, quiet=True)
    assert time.monotonic() - started < 30


def test_bad_arguments_fail_before_anything_starts(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("nothing may start for bad arguments")

    monkeypatch.setattr(launch_module.subprocess, "Popen", must_not_run)
    monkeypatch.setattr(launch_module.tempfile, "mkdtemp", must_not_run)
    with pytest.raises(ValueError, match="^elasticrun: -np must be at least 1, got 0$"):
        launch(rank_times_ten, np=0)
    with pytest.raises(ValueError, match="-np 4 is larger than --max-np 2"):
        launch(rank_times_ten, np=4, max_np=2)
    with pytest.raises(ValueError, match="either hosts or discovery_script"):
        launch(rank_times_ten, hosts="localhost:1", discovery_script="/bin/true")
    with pytest.raises(ValueError, match="invalid slot count"):
        launch(rank_times_ten, hosts="localhost:x")
    with pytest.raises(ValueError, match="discovery script not found"):
        launch(rank_times_ten, discovery_script="/nonexistent/discover.sh")
    with pytest.raises(ValueError, match="timeout"):
        launch(rank_times_ten, timeout=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_flag'"):
        launch(rank_times_ten, no_such_flag=1)
    with pytest.raises(TypeError, match="needs a callable"):
        launch(42)
    with pytest.raises(TypeError, match="np must be an int"):
        launch(rank_times_ten, np="2")


def test_keyword_arguments_become_elasticrun_flags():
    flags = launch_module.elasticrun_flags(
        2, 1, 4, {"localhost": 2, "127.0.0.1": 1}, None,
        {"elastic_timeout": 5, "verbose": True, "log_level": None,
         "blacklist_cooldown_range": (1, 10), "ssh_option": ["A=b", "C=d"]})
    assert flags == ["-np", "2", "--min-np", "1", "--max-np", "4",
                     "-H", "localhost:2,127.0.0.1:1", "--elastic-timeout", "5", "--verbose",
                     "--blacklist-cooldown-range", "1", "10",
                     "--ssh-option", "A=b", "--ssh-option", "C=d"]
    assert launch_module.elasticrun_flags(1, None, None, ["a:1", "b"], None, {}) == \
        ["-np", "1", "-H", "a:1,b"]


def _write_result(results, round_id, rank, size, value):
    folder = results / f"round.{round_id}"
    folder.mkdir(exist_ok=True)
    (folder / f"{rank}.pkl").write_bytes(cloudpickle.dumps(
        {"rank": rank, "size": size, "round": round_id, "worker": str(rank), "value": value}))


def test_only_the_final_rounds_results_count(tmp_path):
    results = tmp_path / "results"
    (results / "errors").mkdir(parents=True)
    _write_result(results, 1, 0, 2, "old-0")     # a worker that left after round 1
    _write_result(results, 1, 1, 2, "old-1")
    _write_result(results, 2, 0, 1, "final-0")
    events = tmp_path / "events.jsonl"
    members = [{"worker_id": "1", "host": "localhost", "rank": 0}]
    events.write_text("\n".join(json.dumps(e) for e in [
        {"event": "round_started", "round": 1, "members": [
            {"worker_id": "0", "host": "localhost", "rank": 0},
            {"worker_id": "1", "host": "localhost", "rank": 1}]},
        {"event": "round_started", "round": 2, "members": members},
        {"event": "job_finished", "round": 2, "size": 1}]) + "\n")
    outcome = launch_module.Outcome(str(results), str(tmp_path / "logs"), str(events), [])
    assert outcome.results(0) == ["final-0"]

    # A rank of the final round without a result fails, naming its worker.
    (results / "round.2" / "0.pkl").unlink()
    (results / "errors" / "1.json").write_text(json.dumps(
        {"worker": "1", "host": "localhost", "rank": 0, "type": "KeyError",
         "message": "'x'", "traceback": "Traceback...\nKeyError: 'x'\n"}))
    logs = tmp_path / "logs" / "worker.1"
    logs.mkdir(parents=True)
    (logs / "stderr").write_text("line\n" * 50 + "KeyError: 'x'\n")
    with pytest.raises(LaunchError) as info:
        launch_module.Outcome(str(results), str(tmp_path / "logs"), str(events),
                               ["elasticrun: worker 1 on localhost exited with code 1"]
                               ).results(0)
    text = str(info.value)
    assert text.startswith("worker 1 on localhost failed: KeyError: 'x'")
    assert "elasticrun: worker 1 on localhost exited with code 1" in text
    assert info.value.stderr_tail.endswith("KeyError: 'x'")
    assert len(info.value.stderr_tail.splitlines()) == launch_module.STDERR_TAIL_LINES


def test_payload_file_is_private(tmp_path):
    paths = launch_module.prepare_workdir(str(tmp_path), pickle.dumps({"sys_path": [], "call": b""}))
    assert os.stat(paths["payload"]).st_mode & 0o777 == 0o600
    assert os.stat(paths["results"]).st_mode & 0o777 == 0o700
