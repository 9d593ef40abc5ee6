"""Waiting on a condition under a generous deadline: tests poll, never sleep a fixed time."""

import time


def wait_until(predicate, what, timeout=120, interval=0.1, output=lambda: ""):
    """``predicate()``'s first truthy value; an AssertionError naming ``what`` (with the tail
    of ``output()``) once ``timeout`` seconds pass without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    tail = output()[-4000:]
    raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f"\n{tail}" if tail else ""))
