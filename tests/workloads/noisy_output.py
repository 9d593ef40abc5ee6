"""A worker that writes what a console cannot hold: a huge line and a tqdm-style bar.

Prints "ready", waits for JOB_OUT/go, then writes BLOB_MB megabytes to stdout
without a newline, a progress bar of BAR_STEPS "\\r" updates to stderr, and
"done" on its own line; then waits for JOB_OUT/end.
"""

import os
import sys
import time

out = os.environ["JOB_OUT"]
print("ready", flush=True)


def wait_for(name):
    deadline = time.monotonic() + 240
    while not os.path.exists(os.path.join(out, name)):
        assert time.monotonic() < deadline, f"no {name} file"
        time.sleep(0.05)


wait_for("go")
block = b"x" * (1 << 20)
for _ in range(int(os.environ.get("BLOB_MB", "64"))):
    sys.stdout.buffer.write(block)
sys.stdout.buffer.write(b"\n")
sys.stdout.flush()
steps = int(os.environ.get("BAR_STEPS", "100000"))
for i in range(1, steps + 1):
    sys.stderr.write(f"\rtraining: {i}/{steps} |{'#' * (20 * i // steps):20}|")
sys.stderr.write("\n")
sys.stderr.flush()
print("done", flush=True)
wait_for("end")         # the test reads the driver's memory while it still runs
