"""The driver sees a crash at once: a worker's output ending (its process exited) wakes
the driver's tick (``OutputSink.stream_ended``; driver.py polls exits on it), instead
of the exit waiting for the next tick's poll (docs/benchmarks.md, "Pauses between hosts")."""

import os
import signal
import sys
import time

from elastic.runner import launcher
from elastic.runner.console import Console


def test_a_sigkilled_workers_output_ends_and_wakes_the_driver():
    sink = Console(quiet=True)
    proc = launcher.start_local("w0", "localhost", [sys.executable, "-c",
                                "print('up', flush=True); import time; time.sleep(600)"],
                                dict(os.environ), sink)
    try:
        assert not sink.stream_ended.wait(0.5)         # running: nothing ended
        proc.kill(signal.SIGKILL)
        assert sink.stream_ended.wait(60), "the killed worker's output never ended"
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() == -signal.SIGKILL
    finally:
        proc.kill(signal.SIGKILL)
        proc.popen.wait(60)
