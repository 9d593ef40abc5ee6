"""Worker output reaches the console in bounded memory (issue 26, part 5).

The splitter and the pump are checked on their own; then a real elasticrun job
whose worker writes 128 MB without a newline and a 100,000-update tqdm-style
bar, while the test reads the driver's peak resident memory from /proc.
"""

import os
import re
import threading

import pytest
from support.jobs import REPO, Job, kill_leftover_jobs
from support.join_cluster import JoinJob

from elastic import streams
from elastic.runner import agent

NOISY = REPO / "tests" / "workloads" / "noisy_output.py"


def split(chunks, max_line=8):
    splitter = streams.LineSplitter(max_line)
    out = []
    for chunk in chunks:
        out += splitter.feed(chunk)
    return out + splitter.finish()


def test_lines_and_progress_updates_are_told_apart():
    assert split([b"a\nb\r\nc\rd\n"]) == [(b"a", False), (b"b", False), (b"c", True),
                                          (b"d", False)]
    # \r\n split across two reads is one line end, not a progress update
    assert split([b"ab\r", b"\ncd"]) == [(b"ab", False), (b"cd", False)]
    # a bar's leading \r ends nothing; the last text before end of file is kept
    assert split([b"\r1/3\r2/3", b"\r3/3"]) == [(b"1/3", True), (b"2/3", True), (b"3/3", False)]


def test_a_long_line_is_cut_once_and_marked():
    mark = streams.CUT_MARK.format(limit=8).encode()
    assert split([b"0123456789abc", b"def", b"ghi\nnext\n"]) == [
        (b"01234567" + mark, False), (b"next", False)]
    assert split([b"x" * 100]) == [(b"x" * 8 + mark, False)]


def test_the_pump_holds_one_line_of_a_pipe_that_never_ends_a_line():
    read_end, write_end = os.pipe()

    def write():
        with os.fdopen(write_end, "wb") as f:
            f.write(b"y" * (8 << 20))
            for i in range(20000):
                f.write(f"\r{i}".encode())
            f.write(b"\nlast\n")

    writer = threading.Thread(target=write)
    writer.start()
    lines = []
    streams.pump_output(os.fdopen(read_end, "rb"), lines.append, progress_interval=3600)
    writer.join()
    assert lines[0].startswith(b"y" * streams.MAX_LINE_BYTES)
    assert lines[0].endswith(streams.CUT_MARK.format(limit=streams.MAX_LINE_BYTES).encode())
    assert len(lines[0]) < streams.MAX_LINE_BYTES + 100
    # one progress update per interval: the first; the bar ends with the line "19999"
    assert lines[1:] == [b"0", b"19999", b"last"]


def peak_rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc status")


@pytest.fixture
def started():
    jobs = []
    yield jobs
    kill_leftover_jobs(jobs)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_the_driver_stays_small_under_a_huge_line_and_a_progress_bar(tmp_path, started):
    blob_mb, steps = 128, 100000
    job = Job(tmp_path, ["-np", "1", "-H", "localhost:1"], script=NOISY,
              env={"BLOB_MB": str(blob_mb), "BAR_STEPS": str(steps)})
    started.append(job.start())
    job.wait_for(lambda: "[0]<stdout>:ready" in job.output(), "the worker to start")
    before = peak_rss_kb(job.proc.pid)
    (job.out / "go").write_text("go")
    job.wait_for(lambda: "[0]<stdout>:done" in job.output(), "the worker's output")
    grown_mb = (peak_rss_kb(job.proc.pid) - before) / 1024
    (job.out / "end").write_text("end")
    print(f"driver peak memory grew {grown_mb:.1f} MB")
    assert job.finish() == 0, job.output()[-3000:]
    text = job.output()
    # Before: readline() held the whole 128 MB line (and its decoded copies).
    assert grown_mb < 48, f"the driver's peak memory grew {grown_mb:.0f} MB"
    cut = [line for line in text.splitlines() if line.startswith("[0]<stdout>:xxx")]
    assert len(cut) == 1 and cut[0].endswith(
        streams.CUT_MARK.format(limit=streams.MAX_LINE_BYTES)), [c[-80:] for c in cut]
    bar = re.findall(rf"^\[0\]<stderr>:training: (\d+)/{steps} ", text, re.M)
    assert 1 <= len(bar) < steps // 10, len(bar)
    assert bar[-1] == str(steps)       # the bar's final state always arrives


def test_an_agent_sends_cut_lines_and_counts_what_it_had_to_drop():
    outbox = agent.Outbox()
    outbox.line("3", "stdout", b"z" * (agent.MAX_LINE_CHARS * 3))
    (sent,), _ = outbox.take()
    assert sent[2] == "z" * agent.MAX_LINE_CHARS + streams.CUT_MARK.format(
        limit=agent.MAX_LINE_CHARS)
    for i in range(agent.MAX_QUEUED_LINES + 5):       # the driver reads nothing meanwhile
        outbox.line("3", "stderr", f"{i}".encode())
    outbox.line("4", "stdout", b"lost too")
    outbox.exited("3", 0)
    lines = []
    while True:
        out, exits = outbox.take()
        lines += out
        if exits:
            break
    assert exits == [["3", 0]]           # after every line, the counts included
    assert len(lines) == agent.MAX_QUEUED_LINES + 2
    assert lines[-2:] == [
        ["3", "stderr", "[elastic: 5 lines dropped: the driver did not read them fast enough]"],
        ["4", "stdout", "[elastic: 1 lines dropped: the driver did not read them fast enough]"]]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_an_agent_stays_small_too(tmp_path):
    class NoisyJoinJob(JoinJob):
        def join_command(self, *args, **kwargs):     # the same agent, the noisy worker
            return super().join_command(*args, **kwargs)[:-1] + [str(NOISY)]

    job = NoisyJoinJob(tmp_path, ["-np", "1"], env={"BLOB_MB": "128", "BAR_STEPS": "100000"})
    try:
        job.start()
        agent_proc = job.join("node-a")
        job.wait_for(lambda: "<stdout>:ready" in job.agent_output("node-a"), "the worker")
        before = peak_rss_kb(agent_proc.pid)
        (job.out / "go").write_text("go")
        job.wait_for(lambda: "<stdout>:done" in job.agent_output("node-a"), "its output")
        grown_mb = (peak_rss_kb(agent_proc.pid) - before) / 1024
        (job.out / "end").write_text("end")
        assert job.finish() == 0, job.output()[-3000:]
        print(f"agent peak memory grew {grown_mb:.1f} MB")
        assert grown_mb < 48, f"the agent's peak memory grew {grown_mb:.0f} MB"
        # the driver got the line from the agent cut at the agent's limit, and the bar
        text = job.output()
        assert streams.CUT_MARK.format(limit=agent.MAX_LINE_CHARS) in text
        assert "training: 100000/100000" in text
    finally:
        job.cleanup()
