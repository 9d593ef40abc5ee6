"""The event log, the one-line-per-change console output and the timeline report."""

import json

import pytest
from support.jobs import Job

from elastic.runner import timeline as report


@pytest.mark.slow
def test_event_log_records_rounds_failures_pauses_and_progress(tmp_path):
    log = tmp_path / "events.jsonl"
    job = Job(tmp_path, ["-np", "4", "--min-np", "2", "-H", "localhost:2,127.0.0.1:2",
                         "--event-log", str(log)], env={"JOB_FAULT": "5:3:kill"})
    job.assert_ok(job.run(), final_size=2)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = [e["event"] for e in events]
    for kind in ("round_started", "worker_ready", "worker_failed", "host_blacklisted", "pause",
                 "progress", "job_finished"):
        assert kind in kinds, kinds
    rounds = [e for e in events if e["event"] == "round_started"]
    assert [r["size"] for r in rounds] == [4, 2]
    assert {m["host"] for m in rounds[1]["members"]} == {"localhost"}
    progress = [e for e in events if e["event"] == "progress"]
    assert all(e["step"] >= 1 for e in progress)
    pause = next(e for e in events if e["event"] == "pause")
    assert pause["round"] == 2 and 0 < pause["seconds"] < 120
    assert [e["worker"] for e in events if e["event"] == "worker_ready"].__len__() == 4
    # One console line per change, with the pause in it.
    lines = [line for line in job.output().splitlines()
             if line.startswith("elasticrun: ") and " round 2: " in line]
    assert len(lines) == 1 and "training paused" in lines[0], job.output()

    png = tmp_path / "timeline.png"
    assert report.main([str(log), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_from_events():
    events = [
        {"time": 100.0, "event": "round_started", "size": 2},
        {"time": 105.0, "event": "worker_failed", "host": "h1"},
        {"time": 105.5, "event": "round_started", "size": 1},
        {"time": 105.7, "event": "pause", "round": 2, "seconds": 0.6},
        {"time": 110.0, "event": "job_finished"},
    ]
    sizes, pauses, failures = report.timeline(events)
    assert sizes == [(0.0, 2), (5.5, 1), (10.0, 1)]
    assert pauses == [(pytest.approx(5.7), 0.6)]
    assert failures == [(5.0, "h1")]


def test_report_rejects_a_bad_file_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert report.main([str(bad), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 1" in err
