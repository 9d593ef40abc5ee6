"""--metrics-port and --tensorboard (issue 30): a real job's numbers, scraped from the real
prometheus_client endpoint while it runs, and read back from the event file TensorBoard's
own reader opens. A worker fails on the way, so failures, pauses and the shrunken world
size must show too, in the metrics and in `elasticctl status` (the snapshot they come from).

The step rate needs two progress reports of rank 0 in one round that the driver reads
(report_progress keeps at most one every REPORT_INTERVAL_S). So rank 0 holds at steps 8,
9 and 10, and each hold lasts until the driver has read that step's report and the
interval since the step has passed: reports 9 and 10 both reach the driver, whatever
the machine's speed.
"""

import json
import re
import socket
import time
import urllib.request

import pytest
from support.jobs import Job
from support.waits import wait_until

from elastic import protocol
from elastic.ctl import cli as ctl_cli
from elastic.runner import cli

prometheus_parser = pytest.importorskip("prometheus_client.parser",
                                        reason="prometheus_client is not installed")
event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is not installed")


REPORT_INTERVAL_S = 0.5          # elastic.report_progress drops calls closer than this


def scrape(port):
    """{(name, labels): value} of every sample the endpoint serves now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in prometheus_parser.text_string_to_metric_families(text)
            for s in family.samples}


def elasticctl_status(monkeypatch, capsys, jobs, *argv):
    """`elasticctl status ARGV` in this process, finding the job by its job file."""
    monkeypatch.setenv(protocol.ENV_JOBS_DIR, str(jobs))
    code = ctl_cli.main(["status", *argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.mark.slow
def test_a_real_job_is_scraped_while_it_runs_and_its_scalars_read_back(tmp_path, monkeypatch,
                                                                         capsys):
    board, jobs = tmp_path / "tb", tmp_path / "jobs"
    job = Job(tmp_path, ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1",
                         "--metrics-port", "0", "--tensorboard", str(board),
                         "--checkpoint-dir", str(tmp_path / "ckpt")],
              env={"JOB_HOLD": "8,9,10", "JOB_EPOCHS": "2", "JOB_FAULT": "3:1:exit",
                   protocol.ENV_JOBS_DIR: str(jobs)}).start()
    port = int(wait_until(lambda: re.search(r"metrics for Prometheus at http://0\.0\.0\.0:(\d+)/",
                                            job.output()), "the metrics line", 120).group(1))
    job.wait_step(8)                      # rank 1 failed at step 3; rank 0 holds at step 8

    def settled():
        m = scrape(port)
        ready = m.get(("elastic_checkpoint_bytes", ())) and m.get(("elastic_pauses_total", ())) \
            and m.get(("elastic_commit_seconds", ())) and m.get(("elastic_sync_seconds", ())) \
            and m.get(("elastic_commits_per_second", ()))    # rank 0 commits while it holds
        return m if ready else None

    m = wait_until(settled, "a checkpoint, a measured pause, commit times and rate to show", 120)
    assert m[("elastic_world_size", ())] == 1
    assert m[("elastic_round", ())] == 2 and m[("elastic_max_np", ())] == 0     # 0: no limit
    assert m[("elastic_rounds_total", ())] == 2
    assert m[("elastic_failures_total", ())] == 1
    assert m[("elastic_blacklisted_hosts", ())] == 1
    assert m[("elastic_pauses_total", ())] == 1
    assert m[("elastic_pause_seconds_count", ())] == 1 and m[("elastic_pause_seconds_sum", ())] > 0
    assert m[("elastic_commit_seconds", ())] > 0 and m[("elastic_sync_seconds", ())] > 0
    assert m[("elastic_commits_per_second", ())] > 0
    assert m[("elastic_checkpoint_bytes", ())] > 0 and m[("elastic_checkpoint_version", ())] >= 1
    assert m[("elastic_checkpoint_age_seconds", ())] >= 0
    assert m[("elastic_progress", (("name", "step"),))] >= 1
    assert ("elastic_progress", (("name", "loss"),)) in m
    assert m[("elastic_evicted_total", ())] == 0 and m[("elastic_drained_hosts", ())] == 0
    assert m[("elastic_preempted_total", ())] == 0 and m[("elastic_drained_total", ())] == 0
    # The snapshot behind them, as elasticctl shows it: rounds, the last pause and failure,
    # the blacklist with its cooldown, the newest checkpoint, progress with its loss.
    status = json.loads(elasticctl_status(monkeypatch, capsys, jobs, "--json"))
    assert [(r["round"], r["size"]) for r in status["rounds"]] == [(1, 2), (2, 1)]
    assert status["last_pause"]["round"] == 2 and status["last_pause"]["seconds"] > 0
    assert status["last_failure"]["host"] == "127.0.0.1"          # rank 1's host
    assert status["hosts"]["blacklisted"] == [
        {"host": "127.0.0.1", "failures": 1, "returns_in_s": None}]   # no cooldown range
    newest = status["checkpoint"]["newest"]
    assert newest["version"] >= 1 and newest["bytes"] > 0 and newest["age_s"] >= 0
    assert isinstance(status["progress"]["loss"], float)
    text = elasticctl_status(monkeypatch, capsys, jobs)
    assert "blacklisted: 127.0.0.1 (1 failures, never returns)" in text, text
    assert re.search(r"^checkpoint: .*ckpt: commit \d+, ", text, re.M), text
    assert re.search(r"^progress: step \d+.*, loss ", text, re.M), text
    # The step rate: steps 9 and 10 are reported, each read by the driver (see above).
    for step in (8, 9, 10):
        job.wait_step(step)
        at = max(r["t"] for r in job.steps() if r["step"] == step)
        if step > 8:
            wait_until(lambda step=step: scrape(port).get(
                ("elastic_progress", (("name", "step"),))) == step,
                f"the driver to read step {step}'s report", 120)
        if step < 10:
            wait_until(lambda at=at: time.time() - at > REPORT_INTERVAL_S,
                       "report_progress's interval since the step", 30)
            job.release(step)
    rate = wait_until(lambda: scrape(port).get(("elastic_steps_per_second", ())),
                      "the step rate to show", 120)
    assert rate > 0
    job.release(10)
    assert job.finish() == 0, job.output()[-3000:]

    files = list(board.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    reader = event_accumulator.EventAccumulator(str(files[0]))
    reader.Reload()
    tags = reader.Tags()["scalars"]
    assert [e.value for e in reader.Scalars("elastic/world_size")] == [2, 1]
    assert [e.value for e in reader.Scalars("elastic/round")] == [1, 2]
    (pause,) = reader.Scalars("elastic/pause_seconds")
    assert pause.value > 0
    losses = reader.Scalars("progress/loss")
    assert len(losses) >= 2 and all(a.step <= b.step for a, b in zip(losses, losses[1:]))
    assert "progress/samples" in tags and "progress/round" not in tags
    rates = reader.Scalars("progress/steps_per_second")
    assert rates and rates[-1].value > 0 and all(e.value >= 0 for e in rates), rates


def test_bad_metrics_and_tensorboard_flags_get_one_line(tmp_path, capsys):
    import sys
    blocker = tmp_path / "file"
    blocker.write_text("")
    for argv, words in ((["--metrics-port", "70000"], "--metrics-port 70000 is not a port"),
                        (["--tensorboard", str(blocker / "tb")], "--tensorboard")):
        assert cli.main(["-np", "1", *argv, sys.executable, "-c", "pass"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err


@pytest.mark.slow
def test_a_metrics_port_in_use_fails_the_job_with_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        job = Job(tmp_path, ["-np", "1", "--metrics-port", str(port)])
        assert job.run(timeout=120) == 1
    out = job.output()
    assert f"elasticrun: error: --metrics-port {port}: cannot listen" in out, out
    assert "Traceback" not in out
