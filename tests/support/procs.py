"""Look at processes the way an operator would: through /proc."""

import os
import signal
import time

from support.waits import wait_until


def environ(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read()
    return dict(item.decode(errors="replace").split("=", 1)
                for item in raw.split(b"\0") if b"=" in item)


def state(pid):
    """The /proc state letter of ``pid`` (R, S, T...), or None once it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            letter = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if letter in ("Z", "X") else letter


def alive(pid):
    return state(pid) is not None


def policies(pid):
    """The scheduling policies of ``pid``'s threads."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found.add(os.sched_getscheduler(int(tid)))
        except OSError:
            continue
    return found


def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def job_workers(out):
    """{pid: environ} of the live worker processes whose JOB_OUT is ``out``."""
    import os
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            env = environ(pid)
        except OSError:
            continue
        if env.get("JOB_OUT") == str(out) and "ELASTIC_WORKER_ID" in env and alive(pid):
            found[pid] = env
    return found


def resources(pid):
    """What a process holds, as an operator sees it: {"fds", "threads", "rss"} (rss in bytes).

    Read from /proc/PID/fd, /proc/PID/task and /proc/PID/statm; raises OSError
    once the process is gone. Used by the bounded-resource tests and the soak.
    """
    import os
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = len(os.listdir(f"/proc/{pid}/task"))
    with open(f"/proc/{pid}/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {"fds": fds, "threads": threads, "rss": rss_pages * os.sysconf("SC_PAGE_SIZE")}


def resource_growth(before, after):
    """{"fds": +n, "threads": +n, "rss": ratio} from two resources() readings."""
    return {"fds": after["fds"] - before["fds"], "threads": after["threads"] - before["threads"],
            "rss": after["rss"] / before["rss"] if before["rss"] else float("inf")}


def pid_of(out, worker_id, timeout=60):
    def find():
        return next((pid for pid, env in job_workers(out).items()
                     if env["ELASTIC_WORKER_ID"] == worker_id), None)
    return wait_until(find, f"the process of worker {worker_id}", timeout)


def assert_no_worker_left(job, within=10):
    deadline = time.monotonic() + within
    left = job_workers(job.out)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = job_workers(job.out)
    for pid in left:                      # do not leak them into the next test
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, (f"workers still running {within} s after the driver went away: "
                      f"{ {pid: env['ELASTIC_WORKER_ID'] for pid, env in left.items()} }\n"
                      + job.output()[-3000:])
