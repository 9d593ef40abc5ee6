"""Connections heal: a reset store connection is remade, never the end of a worker
(docs/failure-model.md). Resets are real: ``ss -K`` destroys the sockets, as a NAT
gateway, a conntrack flush or a load balancer's idle timeout does."""

import os
import shutil
import socket
import subprocess
import sys

import pytest
from support.harness import free_port
from support.jobs import Job
from support.procs import job_workers

from elastic import protocol as control
from elastic.store_link import HealingStore

RESETS_IN_A_FRESH_PROCESS = """
import subprocess, sys
from elastic import protocol as control
from elastic.store_link import HealingStore
port = int(sys.argv[1])
master = control.connect("127.0.0.1", port, 30, is_master=True)
link = HealingStore("127.0.0.1", port, 10)
link.set("a", b"1")
for _ in range(3):
    subprocess.run(["ss", "-K", "-tnH", f"dport = :{port}"], check=True, capture_output=True)
    assert bytes(link.get("a")) == b"1"
print("reconnects", link.reconnects)
"""

needs_ss = pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) is not installed")


def established_to(port):
    out = subprocess.run(["ss", "-tnH", "state", "established", f"dport = :{port}"],
                         capture_output=True, text=True, check=True).stdout
    return len([line for line in out.splitlines() if line.strip()])


def reset_connections_to(port):
    """Destroy every TCP connection to ``port`` on this machine; how many ss listed."""
    listed = established_to(port)
    done = subprocess.run(["ss", "-K", "-tnH", f"dport = :{port}"], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"ss -K cannot destroy sockets here: {done.stderr.strip()}")
    return listed


def keepalive_by_local_port(port):
    """{local port: SO_KEEPALIVE} of this process's TCP connections to ``port``."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        with sock:
            try:
                local, peer = sock.getsockname(), sock.getpeername()
            except OSError:
                continue
            if sock.type == socket.SOCK_STREAM and peer[1] == port:
                found[local[1]] = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE))
    return found


def without_keepalive(port, besides):
    """Local ports of our connections to ``port`` (other than ``besides``) without
    keepalive; asserts there is at least one connection to look at."""
    mine = {k: v for k, v in keepalive_by_local_port(port).items() if k not in besides}
    assert mine, "no connection to look at"
    return [k for k, on in mine.items() if not on]


@needs_ss
def test_a_reset_connection_is_remade_with_one_warning():
    port = free_port()
    master = control.connect("127.0.0.1", port, 30, is_master=True)
    masters = set(keepalive_by_local_port(port))    # the master's own client (TCPStore's)
    warnings = []
    link = HealingStore("127.0.0.1", port, 10, warn=warnings.append)
    ns = link.with_prefix("job")
    ns.set("a", b"1")
    assert without_keepalive(port, masters) == []
    for _ in range(3):
        assert reset_connections_to(port) >= 1
        assert bytes(ns.get("a")) == b"1"          # the call after a reset goes through
        ns.set("b", b"2")
        assert link.reconnects >= 1
    assert bytes(HealingStore("127.0.0.1", port, 10).get("job/b")) == b"2"
    assert len(warnings) == 1, warnings            # one warning, not one per reset
    assert "reconnecting" in warnings[0]
    assert without_keepalive(port, masters) == []  # ... on the new connections too
    del master


@needs_ss
def test_a_reset_prints_our_one_line_not_torchs_cpp_trace_unless_the_user_asks():
    """Torch logs each failed store call with a C++ stack (~25 lines); a process with a
    healing connection prints only our one warning for three resets. A user who sets
    TORCH_CPP_LOG_LEVEL keeps torch's own lines (this also shows the check can fail)."""
    def run(**env):
        environ = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
        done = subprocess.run([sys.executable, "-c", RESETS_IN_A_FRESH_PROCESS,
                               str(free_port())], env=dict(environ, OMP_NUM_THREADS="1", **env),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "reconnects 3" in done.stdout, done.stderr[-3000:]
        return [line for line in done.stderr.splitlines() if line.strip()]
    quiet = run()
    assert len(quiet) == 1 and quiet[0].startswith("elastic: warning: the connection to the "
                                                   "control store at"), quiet
    loud = run(TORCH_CPP_LOG_LEVEL="WARNING")
    assert sum("TCPStore" in line for line in loud) >= 3, loud[:40]


@needs_ss
def test_a_link_without_retry_raises_and_the_next_link_works():
    port = free_port()
    master = control.connect("127.0.0.1", port, 30, is_master=True)
    link = HealingStore("127.0.0.1", port, 10, reconnect_within_s=0)
    link.set("a", b"1")
    reset_connections_to(port)
    with pytest.raises(RuntimeError):
        link.set("a", b"2")
    HealingStore("127.0.0.1", port, 10).set("a", b"3")
    assert bytes(HealingStore("127.0.0.1", port, 10).get("a")) == b"3"
    del master


@needs_ss
@pytest.mark.slow
def test_store_connections_reset_in_training_and_while_idle_then_a_change_works(tmp_path):
    """Every store connection of the job (workers' control and heartbeat connections,
    the driver's helpers) is destroyed while it trains, then again while rank 1's
    connection sits idle at a hold; then a host joins: the job goes on through the
    change and finishes with nothing lost."""
    job = Job(tmp_path, ["-np", "2", "--min-np", "2", "--worker-timeout", "20"],
              hosts=["localhost:2"], env={"JOB_HOLD": "6", "JOB_EPOCHS": "2"}).start()
    try:
        job.wait_step(2)
        port = int(next(iter(job_workers(job.out).values()))[control.ENV_PORT])
        assert reset_connections_to(port) >= 4        # 2 workers x (control + heartbeat)
        job.wait_step(6)
        # A reset connection is remade when next used: the heartbeats' within a beat.
        job.wait_for(lambda: established_to(port) >= 2, "the heartbeats to reconnect")
        assert reset_connections_to(port) >= 2
        job.set_hosts(["localhost:3"])
        job.wait_for(lambda: "round 2" in job.output() or
                     any(r["size"] == 3 for r in job.steps()), "round 2 to be published")
        job.release(6)
        code = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    job.assert_ok(code, epochs=2, final_size=3)
    out = job.output()
    assert "reconnecting" in out, out[-3000:]
    assert "blacklist" not in out, out[-3000:]
    assert "frame #" not in out and "TCPStore.cpp" not in out, out[-3000:]   # our line only
