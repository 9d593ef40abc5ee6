"""Workers on hosts that are not local, started through real ssh.

The unit tests check the pieces (what counts as local, the ssh command line,
the remote bootstrap run locally over a pipe). The slow tests start a
throwaway sshd on 127.0.0.2/127.0.0.3 (tests/support/sshd.py) and run whole jobs
through it: training to the end, the secret on no command line, an
unreachable host, and a dropped ssh connection.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from support.jobs import Job, hosts_by_rank, sizes_in_order
from support.sshd import sshd  # noqa: F401  (the module-scoped fixture)

from elastic import protocol as control
from elastic.runner import cli, launcher, remote

REMOTE_PY = [sys.executable, "-I", launcher.REMOTE_SCRIPT]
GONE_TIMEOUT_S = 20      # "about 10 s", with room for a loaded 2-core machine


# -- /proc helpers ---------------------------------------------------------------------------

def _read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _stat(pid):
    """(state, ppid) of a live process, or None."""
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    return fields[0].decode(), int(fields[1])


def alive(pid):
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def environ(pid):
    raw = _read(f"/proc/{pid}/environ") or b""
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)


def cmdline(pid):
    return (_read(f"/proc/{pid}/cmdline") or b"").split(b"\0")


def ancestors(pid):
    chain = []
    while pid > 1:
        st = _stat(pid)
        if st is None:
            break
        pid = st[1]
        chain.append(pid)
    return chain


def descendants(root):
    parents = {p: (_stat(p) or (None, None))[1] for p in pids()}
    found, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def comm(pid):
    return (_read(f"/proc/{pid}/comm") or b"").decode().strip()


def job_workers(job, host=None):
    """Live worker processes of this job (train_job.py with the job's JOB_OUT and a
    worker id; the driver's own command line also ends in train_job.py)."""
    out = str(job.out).encode()
    found = []
    for pid in pids():
        if not alive(pid) or not any(a.endswith(b"train_job.py") for a in cmdline(pid)):
            continue
        env = environ(pid)
        if env.get(b"JOB_OUT") == out and b"ELASTIC_WORKER_ID" in env and (host is None or
                                           env.get(b"ELASTIC_HOSTNAME") == host.encode()):
            found.append(pid)
    return found


def wait_until(predicate, what, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def driver_lines(job):
    return [line for line in job.output().splitlines() if line.startswith("elasticrun:")]


# -- the pieces --------------------------------------------------------------------------------

def test_bootstrap_uses_the_control_plane_names():
    assert remote.SECRET_ENV == control.ENV_SECRET
    assert remote.SECRET_FILE_ENV == control.ENV_SECRET_FILE
    assert remote.ADDR_ENV == control.ENV_ADDR
    from elastic import auth
    assert remote.MIN_SECRET_BYTES == auth.MIN_SECRET_BYTES
    assert remote.EXAMPLE_SECRETS == auth.EXAMPLE_SECRETS


def test_only_this_machine_is_local():
    names = launcher.local_names()
    for host in ("localhost", "127.0.0.1", "::1", "[::1]", socket.gethostname(), "127.0.0.2"):
        assert launcher.is_local(host, names, ssh_loopback=False), host
    for host in ("10.255.1.2", "no-such-host.invalid"):
        assert not launcher.is_local(host, names, ssh_loopback=False), host
    # The switch the ssh tests use: other loopback addresses become remote hosts.
    for host in ("localhost", "127.0.0.1", "::1", socket.gethostname()):
        assert launcher.is_local(host, names, ssh_loopback=True), host
    for host in ("127.0.0.2", "127.0.0.3", "10.255.1.2"):
        assert not launcher.is_local(host, names, ssh_loopback=True), host


def test_interface_address():
    assert launcher.interface_ipv4("lo") == "127.0.0.1"
    with pytest.raises(OSError, match="no such interface"):
        launcher.interface_ipv4("nosuchif0")
    assert launcher.source_address("127.0.0.2").startswith("127.")
    assert launcher.source_address("no-such-host.invalid") is None


def test_ssh_command_line():
    settings = launcher.SshSettings(2222, "/keys/id", ["UserKnownHostsFile=/kh",
                                                       "ConnectTimeout=30"], "python3")
    argv = settings.argv("node7")
    text = " ".join(argv)
    for option in ("BatchMode=yes", "ConnectTimeout=10", "ServerAliveInterval=5",
                   "ServerAliveCountMax=3", "UserKnownHostsFile=/kh"):
        assert f"-o {option}" in text
    # ssh keeps the first value of an option: the user's must come before ours.
    assert text.index("ConnectTimeout=30") < text.index("ConnectTimeout=10")
    assert "StrictHostKeyChecking" not in text
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-i") + 1] == "/keys/id"
    assert argv[-2:] == ["node7", f"exec python3 -I {launcher.REMOTE_SCRIPT}"]
    assert launcher.SshSettings().argv("[fd00::5]")[-2] == "fd00::5"


def test_the_secret_travels_in_the_spec_not_the_env():
    env = {"ELASTIC_SECRET": "s3cr3t", "ELASTIC_RANK": "1", "PATH": "/bin", "HOME": "/root",
           "SSH_AUTH_SOCK": "/tmp/agent", "PYTHONPATH": "/repo"}
    spec = json.loads(launcher.remote_spec(["python", "x.py"], env, "/repo"))
    assert spec["secret"] == "s3cr3t"
    assert spec["env"] == {"ELASTIC_RANK": "1", "PATH": "/bin", "PYTHONPATH": "/repo"}
    assert spec["command"] == ["python", "x.py"] and spec["cwd"] == "/repo"


def test_ssh_exit_codes_say_what_they_mean():
    tail = []                # the last stderr line of ssh, kept by its output pump
    proc = launcher.SshWorkerProcess("0", "h", popen=None, pumps=[], tail=tail)
    assert proc.describe_exit(255) == " (ssh failure)"
    tail.append("ssh: connect to host h port 22: Connection refused")
    assert proc.describe_exit(255) == " (ssh failure: ssh: connect to host h port 22: " \
        "Connection refused)"
    assert "killed by SIGKILL" in proc.describe_exit(-9)
    assert proc.describe_exit(1) == "" and proc.describe_exit(137) == ""
    assert launcher.WorkerProcess("1", "h", None, []).describe_exit(255) == ""


@pytest.mark.parametrize("argv,error", [
    (["--ssh-option", "nonsense"], "not KEY=VALUE"),
    (["--ssh-option", "=x"], "not KEY=VALUE"),
    (["-p", "70000"], "not a port number"),
    (["-i", "/no/such/key"], "does not exist"),
    (["--network-interface", "nosuchif0"], "no such interface"),
])
def test_bad_ssh_flags_are_usage_errors(argv, error):
    args = cli.build_parser().parse_args(["-np", "1"] + argv + [sys.executable, "x.py"])
    with pytest.raises(cli.UsageError, match=error):
        cli.config_from_args(args)


def test_ssh_flags_reach_the_config(tmp_path):
    key = tmp_path / "id"
    key.write_text("k")
    args = cli.build_parser().parse_args([
        "-np", "1", "-p", "2222", "-i", str(key), "--ssh-option", "UserKnownHostsFile=/kh",
        "--ssh-option", "Ciphers=aes128-ctr", "--remote-python", "/opt/py3",
        "--network-interface", "lo", sys.executable, "x.py"])
    cfg = cli.config_from_args(args)
    assert (cfg.ssh_port, cfg.ssh_identity_file, cfg.remote_python, cfg.network_interface) == \
        (2222, str(key), "/opt/py3", "lo")
    assert cfg.ssh_options == ["UserKnownHostsFile=/kh", "Ciphers=aes128-ctr"]


# -- the remote bootstrap, run locally over a pipe ---------------------------------------------

PROBE = r"""
import json, os, stat, sys
fd = int(os.environ["ELASTIC_SECRET_FD"])
kind = "pipe" if stat.S_ISFIFO(os.fstat(fd).st_mode) else "other"
secret = b"".join(iter(lambda: os.read(fd, 4096), b"")).decode()
json.dump({"secret_env": "ELASTIC_SECRET" in os.environ, "kind": kind,
           "file_env": "ELASTIC_SECRET_FILE" in os.environ, "secret": secret,
           "cwd": os.getcwd(), "addr": os.environ.get("ELASTIC_STORE_ADDR"),
           "extra": os.environ.get("EXTRA")}, sys.stdout)
sys.stdout.flush()
sys.exit(int(sys.argv[1]))
"""


def _bootstrap(command, env=None, cwd=None, secret="ab" * 32, extra_env=None):
    proc = subprocess.Popen(REMOTE_PY, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env=dict(os.environ, SSH_CONNECTION="10.9.8.7 5555 10.0.0.1 22",
                                     **(extra_env or {})))
    spec = {"command": command, "cwd": cwd, "env": env or {}, "secret": secret}
    proc.stdin.write(json.dumps(spec).encode() + b"\n")
    proc.stdin.flush()
    return proc


def _finish(proc, timeout=60):
    """Wait with stdin still open (closing it would kill the worker), then read."""
    proc.wait(timeout)
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.stdin.close()
    return out, err


def _secret_files():
    import tempfile
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("elastic-secret-")}


def test_bootstrap_hands_the_secret_over_on_a_pipe(tmp_path):
    before = _secret_files()
    proc = _bootstrap([sys.executable, "-c", PROBE, "7"], env={"EXTRA": "1"}, cwd=str(tmp_path),
                      extra_env={"ELASTIC_SECRET": "leaked-from-login-env",
                                 "ELASTIC_SECRET_FILE": "/login/env/file"})
    out, err = _finish(proc)
    assert proc.returncode == 7, err
    seen = json.loads(out)
    assert seen == {"secret_env": False, "kind": "pipe", "file_env": False,
                    "secret": "ab" * 32, "cwd": str(tmp_path),
                    "addr": "10.9.8.7",      # no address given: where ssh came from
                    "extra": "1"}
    assert _secret_files() <= before, "the secret was written to a file"


def test_a_sigkilled_bootstrap_leaves_no_secret_behind(tmp_path):
    before = _secret_files()
    started = tmp_path / "started"
    proc = _bootstrap([sys.executable, "-c",
                       f"import time; open({str(started)!r}, 'w'); time.sleep(60)"])
    wait_until(started.exists, "the worker to start")
    os.kill(proc.pid, signal.SIGKILL)
    _finish(proc)
    assert _secret_files() <= before


def test_bootstrap_reports_a_signal_death_as_128_plus_n():
    proc = _bootstrap([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"])
    _finish(proc)
    assert proc.returncode == 128 + signal.SIGKILL   # never 255, which means "ssh failed"


@pytest.mark.parametrize("secret", ["", "s", "0123456789abcde", "replace-me-with-openssl-rand-hex-32"])
def test_bootstrap_refuses_a_weak_secret_in_one_line(tmp_path, secret):
    marker = tmp_path / "ran"
    proc = _bootstrap([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], secret=secret)
    _, err = _finish(proc)
    assert proc.returncode == remote.WEAK_SECRET == 2
    assert err.decode().count("\n") == 1 and "refusing a job secret" in err.decode()
    assert not marker.exists()


def test_bootstrap_cannot_start_the_command_in_one_line():
    proc = _bootstrap(["/no/such/program"])
    _, err = _finish(proc)
    assert proc.returncode == remote.BOOTSTRAP_FAILED
    assert err.decode().count("\n") == 1 and "cannot start '/no/such/program'" in err.decode()


def test_bootstrap_kills_the_worker_when_its_stdin_ends(tmp_path):
    pid_file = tmp_path / "pid"
    script = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
              "time.sleep(600)")
    proc = _bootstrap([sys.executable, "-c", script])
    wait_until(lambda: pid_file.exists() and pid_file.read_text(), "the worker to start", 60)
    worker = int(pid_file.read_text())
    assert alive(worker)
    began = time.monotonic()
    proc.stdin.close()                       # what a dropped ssh connection looks like
    proc.wait(GONE_TIMEOUT_S)
    wait_until(lambda: not alive(worker), "the worker to die", GONE_TIMEOUT_S)
    assert time.monotonic() - began < GONE_TIMEOUT_S


# -- real jobs through a real sshd --------------------------------------------------------------

def remote_job(tmp_path, sshd, args, env=None):  # noqa: F811
    return Job(tmp_path, list(sshd.args) + list(args),
               env=dict(env or {}, ELASTIC_SSH_LOOPBACK="1"))


@pytest.fixture
def start():
    """Start jobs; any still running when the test ends (it failed) are SIGKILLed, and
    their ssh clients and remote workers go with the driver."""
    started = []

    def _start(job):
        started.append(job)
        return job.start()

    yield _start
    for job in started:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait(30)


def assert_no_job_processes_left(job):
    wait_until(lambda: not job_workers(job), "every worker of the job to exit", 30)


@pytest.mark.slow
def test_remote_hosts_train_to_the_end(tmp_path, sshd, start):  # noqa: F811
    a, b = sshd.addrs
    job = start(remote_job(tmp_path, sshd, ["-np", "2", "-H", f"{a}:1,{b}:1"],
                           env={"JOB_HOLD": "2"}))
    job.wait_step(2)
    workers = job_workers(job)
    assert len(workers) == 2, workers
    for pid in workers:
        chain = ancestors(pid)
        assert job.proc.pid not in chain, "a worker runs as a local child of the driver"
        assert any(comm(p).startswith("sshd") for p in chain), [comm(p) for p in chain]
        assert any(a.endswith(b"remote.py") for a in cmdline(chain[0]))
    job.release(2)
    job.assert_ok(job.finish(), final_size=2)
    records = job.steps()
    assert sizes_in_order(records) == [2]
    assert hosts_by_rank(records, 1) == {0: a, 1: b}
    assert "ssh failure" not in job.output()
    assert_no_job_processes_left(job)


@pytest.mark.slow
def test_the_secret_is_on_no_command_line(tmp_path, sshd, start):  # noqa: F811
    a, b = sshd.addrs
    job = start(remote_job(tmp_path, sshd, ["-np", "2", "-H", f"{a}:1,{b}:1"],
                           env={"JOB_HOLD": "2", "JOB_SECRET_OUT": "1"}))
    job.wait_step(2)
    workers = job_workers(job)
    assert len(workers) == 2, workers
    secrets = set()
    for pid in workers:
        env = environ(pid)
        assert b"ELASTIC_SECRET" not in env, "the secret itself is in a worker's environment"
        assert b"ELASTIC_SECRET_FILE" not in env, "a secret file (remote.py uses a pipe)"
        # Its key, as the worker wrote it down (JOB_SECRET_OUT): gone from its environment.
        secrets.add((job.out / f"secret.{env[b'ELASTIC_WORKER_ID'].decode()}").read_bytes())
    assert len(secrets) == 1
    secret = secrets.pop()
    assert re.fullmatch(rb"[0-9a-f]{64}", secret), secret
    # This job's processes: the driver and its ssh clients, and each worker with
    # its chain up through remote.py and sshd.
    ours = {job.proc.pid} | descendants(job.proc.pid)
    for pid in workers:
        ours |= {pid} | set(ancestors(pid)[:3]) | descendants(pid)
    for pid in pids():
        line = b" ".join(cmdline(pid))
        assert secret not in line, f"the secret is on the command line of {pid}: {line!r}"
        assert secret not in b"\0".join(k + b"=" + v for k, v in environ(pid).items()), \
            f"the secret is in the environment of {pid} ({comm(pid)})"
        if pid in ours:
            assert b"ELASTIC_SECRET=" not in line, line
    assert any(b"ssh" in cmdline(p)[0] for p in ours), "no ssh client among the job's processes"
    job.release(2)
    job.assert_ok(job.finish(), final_size=2)
    assert_no_job_processes_left(job)


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["unused-port", "no-such-host.invalid"])
def test_unreachable_host_is_one_ssh_failure(tmp_path, sshd, bad):  # noqa: F811
    bad = sshd.unused_addr if bad == "unused-port" else bad
    good = sshd.addrs[0]
    job = remote_job(tmp_path, sshd, ["-np", "1", "--min-np", "1", "-H", f"{bad}:1,{good}:1"])
    job.assert_ok(job.run(), final_size=1)
    assert set(hosts_by_rank(job.steps(), max(r["round"] for r in job.steps())).values()) == \
        {good}
    about_ssh = [line for line in driver_lines(job) if "ssh" in line]
    assert len(about_ssh) == 1, job.output()
    assert bad in about_ssh[0] and "code 255 (ssh failure" in about_ssh[0], about_ssh
    assert "blacklisting host" in about_ssh[0]
    assert "Traceback" not in job.output()
    assert_no_job_processes_left(job)


@pytest.mark.slow
def test_dropped_ssh_connection_ends_its_worker(tmp_path, sshd, start):  # noqa: F811
    a, b = sshd.addrs
    job = start(remote_job(tmp_path, sshd, ["-np", "2", "--min-np", "1",
                                            "-H", f"{a}:1,{b}:1"], env={"JOB_HOLD": "3"}))
    job.wait_step(3)
    [worker] = job_workers(job, host=b)
    bootstrap = ancestors(worker)[0]
    clients = [p for p in descendants(job.proc.pid)
               if os.path.basename(cmdline(p)[0]) == b"ssh" and b.encode() in cmdline(p)]
    assert len(clients) == 1, clients
    began = time.monotonic()
    os.kill(clients[0], signal.SIGKILL)
    wait_until(lambda: not alive(worker) and not alive(bootstrap),
               "the remote worker to exit after its ssh connection dropped", GONE_TIMEOUT_S)
    gone_after = time.monotonic() - began
    job.release(3)
    job.assert_ok(job.finish(), final_size=1)
    assert sizes_in_order(job.steps())[0] == 2 and sizes_in_order(job.steps())[-1] == 1
    lost = [line for line in driver_lines(job) if "ssh connection lost" in line]
    assert len(lost) == 1 and f"blacklisting host {b}" in lost[0], job.output()
    assert_no_job_processes_left(job)
    print(f"remote worker gone {gone_after:.2f} s after its ssh client was killed")


@pytest.mark.slow
def test_a_killed_driver_leaves_no_remote_worker(tmp_path, sshd, start):  # noqa: F811
    a, b = sshd.addrs
    job = start(remote_job(tmp_path, sshd, ["-np", "2", "-H", f"{a}:1,{b}:1"],
                           env={"JOB_HOLD": "2"}))
    job.wait_step(2)
    assert len(job_workers(job)) == 2
    os.kill(job.proc.pid, signal.SIGKILL)
    wait_until(lambda: not job_workers(job), "the remote workers to exit after the driver died",
               GONE_TIMEOUT_S)
    assert job.finish() == -signal.SIGKILL
