"""elasticctl (issue 30): a running job's status, a live view, and steering.

The rules and the request inbox are tested without a driver (the inbox on a real
TCPStore); one real elasticrun job is then watched (status, status --json, --addr
with the secret, top in a real tmux terminal) and steered (resize --max-np down and
up, drain, stop), with forged requests in between (an outsider's, and one sealed with
the workers' key) that must change nothing. Waits poll a condition under a generous
deadline; nothing sleeps to let something happen.
"""

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from support.harness import REPO, free_port
from support.jobs import Job
from support.procs import assert_no_worker_left
from support.waits import wait_until

from elastic import protocol as control
from elastic.auth import Sealer
from elastic.ctl import cli
from elastic.ctl.client import Client, CtlError, Target, find_target
from elastic.protocol import ControlStore, Doorbell, Keys
from elastic.runner import jobfiles, steering
from elastic.runner.control_plane import DriverControl

SECRET = "s" * 32


def forge(raw, name, request, secret="x" * 32):
    """What an outsider who reaches the store can do: list the keys to learn
    elasticctl's namespace, write a request sealed with a secret of its own (a
    compromised worker: the workers' key), and ring the inbox."""
    namespace = next(k for k in raw.list_keys() if k.endswith("/" + Keys.CTL_HELLO))
    namespace = namespace[:-len(Keys.CTL_HELLO)]
    blob = Sealer(secret, job=namespace.rstrip("/")).seal(
        Keys.ctl_request(name), json.dumps(request).encode())
    raw.set(namespace + Keys.ctl_request(name), blob)
    raw.append(namespace + Keys.CTL_INBOX, f"{name}\n".encode())


# -- the rules, without processes ---------------------------------------------------------------
def test_drain_is_refused_for_unknown_hosts_and_below_min_np():
    slots = {"a": 2, "b": 1}
    assert steering.drain_refusal("b", slots, frozenset(), min_np=2) is None
    assert "not one of the job's hosts (a, b)" in steering.drain_refusal("c", slots, frozenset(), 2)
    assert "would leave 1 slots, fewer than --min-np 2" in steering.drain_refusal(
        "a", slots, frozenset(), 2)
    assert "would leave 0 slots" in steering.drain_refusal("a", slots, frozenset({"b"}), 1)


def test_resize_is_refused_below_min_np_or_for_a_non_number():
    assert steering.resize_refusal(3, min_np=2) is None
    assert "smaller than the job's --min-np 2" in steering.resize_refusal(1, 2)
    for bad in (0, -1, "3", 2.5, True, None):
        assert "whole number of at least 1" in steering.resize_refusal(bad, 1), bad


def test_only_known_ops_with_their_arguments_are_well_formed():
    assert steering.well_formed({"op": "drain", "host": "a"})
    assert steering.well_formed({"op": "resize", "max_np": 2})
    for bad in ({"op": "drain"}, {"op": "drain", "host": ""}, {"op": "resize"}, {"op": "rm"},
                {"host": "a"}, ["op"], None):
        assert not steering.well_formed(bad), bad


def test_the_inbox_answers_a_sealed_request_once_and_ignores_forged_and_replayed_ones():
    port = free_port()
    server = control.listen("127.0.0.1", 30, port=port)
    driver = ControlStore(server, SECRET)
    inbox = steering.Inbox(driver)
    client = ControlStore(control.connect("127.0.0.1", port, 30), SECRET)
    bell = Doorbell(client, Keys.CTL_INBOX)
    # An outsider finds the job's namespace by listing keys, and seals with its own secret.
    driver.put(Keys.CTL_HELLO, {"pid": 1})
    forge(control.connect("127.0.0.1", port, 30), "forged", {"op": "stop"})
    client.put(Keys.ctl_request("mine"), {"op": "drain", "host": "a"})
    bell.ring("mine")
    got = wait_until(lambda: inbox.poll(time.monotonic()), "the inbox to see a request", 30)
    assert got == [("mine", {"op": "drain", "host": "a"})]
    assert inbox.ignored == 1                                   # the forged stop
    assert client.get(Keys.ctl_request("mine")) is None         # read once, then deleted
    # The same request copied back and rung again is not obeyed twice.
    client.put(Keys.ctl_request("mine"), {"op": "drain", "host": "a"})
    bell.ring("mine")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert inbox.poll(time.monotonic()) == []
        time.sleep(steering.LOOK_S)
    inbox.reply("mine", {"ok": True}, time.monotonic())
    assert client.get(Keys.ctl_reply("mine")) == {"ok": True}


def test_a_request_sealed_with_the_workers_key_is_ignored():
    """elasticctl has a key of its own, derived from the job secret under another label
    than the workers' key: a compromised worker can neither steer nor pass the hello."""
    plane = DriverControl({"localhost": 1}, {"localhost"}, control.worker_key(SECRET))
    inbox = steering.open_inbox(plane, SECRET)            # what the driver's Watch opens
    address, port = plane.binding.local_connect_address(), plane.port
    raw = control.connect(address, port, 30)
    # What a worker's key can write: in the workers' namespace, where its own values go,
    worker = ControlStore(raw, control.worker_key(SECRET))
    worker.put(Keys.ctl_request("as-worker"), {"op": "stop"})
    Doorbell(worker, Keys.CTL_INBOX).ring("as-worker")
    # and in elasticctl's namespace, found by listing keys, sealed with the workers' key.
    forge(raw, "forged-by-worker", {"op": "stop"}, secret=control.worker_key(SECRET))
    obeyed, done = [], threading.Event()

    def driver_loop():
        while not done.is_set():
            for name, request in inbox.poll(time.monotonic()):
                obeyed.append(request)
                inbox.reply(name, {"ok": True, "message": request["op"]}, time.monotonic())
            time.sleep(0.05)

    answering = threading.Thread(target=driver_loop, daemon=True)
    answering.start()
    try:
        with pytest.raises(CtlError, match="no elasticrun job with this secret answers"):
            Client(Target(address, port, control.worker_key(SECRET), "worker"))
        client = Client(Target(address, port, SECRET, "the job secret"))
        assert client.request("drain", host="a")["message"] == "drain"
    finally:
        done.set()
        answering.join(30)
        plane.close()
    # The worker-key requests were rung before elasticctl's, so the inbox has read them.
    assert obeyed == [{"op": "drain", "host": "a"}]
    assert inbox.ignored == 1          # the forged one in its namespace; the other unseen


# -- finding the job ----------------------------------------------------------------------------
def test_job_files_find_the_one_job_ask_which_of_several_and_drop_dead_ones(tmp_path):
    with pytest.raises(CtlError, match="no running elasticrun job found"):
        find_target(environ={control.ENV_JOBS_DIR: str(tmp_path / "jobs")})
    path = jobfiles.write({"address": "127.0.0.1", "port": 1234, "secret": SECRET},
                          str(tmp_path / "jobs"))
    assert os.stat(path).st_mode & 0o777 == 0o600               # it holds the secret
    assert os.stat(tmp_path / "jobs").st_mode & 0o777 == 0o700
    tmp_path = tmp_path / "jobs"
    env = {control.ENV_JOBS_DIR: str(tmp_path)}
    target = find_target(environ=env)
    assert (target.address, target.port, target.secret) == ("127.0.0.1", 1234, SECRET)
    # A second live driver (our parent stands in for it): the user must choose.
    other = json.loads(open(path).read())
    other["pid"] = os.getppid()
    (tmp_path / f"{os.getppid()}.json").write_text(json.dumps(other))
    with pytest.raises(CtlError, match=r"2 jobs are running here .*--job PID"):
        find_target(environ=env)
    assert find_target(job=os.getppid(), environ=env).label == f"pid {os.getppid()}"
    # A driver that died without cleaning up is skipped, and its file removed.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    other["pid"] = dead.pid
    stale = tmp_path / f"{dead.pid}.json"
    stale.write_text(json.dumps(other))
    assert len(jobfiles.running(str(tmp_path))) == 2 and not stale.exists()


def test_bad_input_gets_one_line_and_a_non_zero_exit(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(control.ENV_JOBS_DIR, str(tmp_path))
    monkeypatch.delenv(control.ENV_SECRET_FILE, raising=False)
    cases = [([], 2, "give a command"), (["resize"], 2, "--max-np"),
             (["--secret-file", "f", "status"], 2, "goes with --addr"),
             (["--addr", "nohost", "status"], 1, "is not HOST:PORT"),
             (["--addr", "127.0.0.1:1", "status"], 1, "needs the job secret"),
             (["--addr", "127.0.0.1:1", "--secret-file", str(tmp_path / "none"), "status"], 1,
              "No such file"),
             (["status"], 1, "no running elasticrun job found")]
    for argv, code, words in cases:
        assert cli.main(argv) == code, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and err.startswith("elasticctl: error:"), err


# -- a real job ---------------------------------------------------------------------------------
def ctl(job, *argv, check=True):
    """``python -m elastic.ctl ARGV`` as a user runs it (its own process)."""
    done = subprocess.run([sys.executable, "-m", "elastic.ctl", *argv], env=job.env,
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    if check:
        assert done.returncode == 0, (argv, done.stdout, done.stderr, job.output()[-3000:])
    return done


def ctl_here(job, monkeypatch, capsys, *argv):
    """The same, in this process (the test already paid for importing torch)."""
    monkeypatch.setenv(control.ENV_JOBS_DIR, job.env[control.ENV_JOBS_DIR])
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def status_of(job, monkeypatch, capsys):
    code, out, err = ctl_here(job, monkeypatch, capsys, "status", "--json")
    assert code == 0, err
    return json.loads(out)


def rounds(path):
    return [e["size"] for e in map(json.loads, path.read_text().splitlines())
            if e["event"] == "round_started"]


def tmux_top(job, tmp_path):
    """``elasticctl top`` in a real terminal: it draws the members, redraws, and Ctrl-C ends
    it. False when there is no tmux to run it in."""
    if shutil.which("tmux") is None:
        return False
    sock, session = f"elastic-test-{os.getpid()}", "top"
    tmux = ["tmux", "-L", sock]
    env_args = [f"{k}={job.env[k]}" for k in (control.ENV_JOBS_DIR, "PYTHONPATH")]
    subprocess.run(tmux + ["new-session", "-d", "-s", session, "-x", "160", "-y", "50",
                           "env", *env_args, sys.executable, "-m", "elastic.ctl", "top",
                           "--interval", "0.5"], check=True, cwd=REPO)
    try:
        def screen():
            done = subprocess.run(tmux + ["capture-pane", "-p", "-t", session],
                                  capture_output=True, text=True)
            return done.stdout if done.returncode == 0 else ""

        def drawn():
            text = screen()
            return text if "elasticctl top" in text and re.search(
                r"^1\s+1\s+127\.0\.0\.1\s+training", text, re.M) else None

        first = wait_until(drawn, "top to draw both members", 120)
        assert re.search(r"^0\s+0\s+localhost\s+training", first, re.M), first
        stamp = re.search(r"elasticctl top\s+(\d\d:\d\d:\d\d)", first).group(1)
        wait_until(lambda: (s := re.search(r"elasticctl top\s+(\d\d:\d\d:\d\d)", screen()))
                   and s.group(1) != stamp, "top to redraw", 60)
        subprocess.run(tmux + ["send-keys", "-t", session, "C-c"], check=True)
        wait_until(lambda: subprocess.run(tmux + ["has-session", "-t", session],
                                          capture_output=True).returncode != 0,
                   "top to end on Ctrl-C", 60)
    finally:
        subprocess.run(tmux + ["kill-server"], capture_output=True)
    return True


@pytest.mark.slow
def test_watch_and_steer_a_real_job(tmp_path, monkeypatch, capsys):
    events = tmp_path / "events.jsonl"
    job = Job(tmp_path, ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1",
                         "--event-log", str(events)],
              env={"JOB_HOLD": "5,10,15,20", "JOB_EPOCHS": "8",
                   control.ENV_JOBS_DIR: str(tmp_path / "jobs")}).start()
    job.wait_step(5)
    # -- watching: the status found through the job file, and the same from elsewhere ------
    status = ctl(job, "status").stdout
    assert re.search(rf"job pid {job.proc.pid}: round 1, 2 workers \(min 1, no max\)", status)
    assert re.search(r"^1\s+1\s+127\.0\.0\.1\s+training\s+\d+", status, re.M), status
    wait_until(lambda: all(m["commits"] > 0 and m["commit_s"] is not None and m["sync_s"]
                           for m in status_of(job, monkeypatch, capsys)["members"]),
               "every member's commits to show", 60)
    record = jobfiles.running(job.env[control.ENV_JOBS_DIR])[0]
    secret_file = tmp_path / "secret"
    secret_file.write_text(record["secret"])
    addr = f"{record['address']}:{record['port']}"
    code, out, err = ctl_here(job, monkeypatch, capsys, "--addr", addr, "--secret-file",
                              str(secret_file), "status")
    assert code == 0 and "round 1, 2 workers" in out, err
    secret_file.write_text("w" * 32)
    code, out, err = ctl_here(job, monkeypatch, capsys, "--addr", addr, "--secret-file",
                              str(secret_file), "stop")
    assert code == 1 and "no elasticrun job with this secret answers" in err
    top_ran = tmux_top(job, tmp_path)
    # -- forged drains (an outsider's; a worker's key), written where the driver looks,
    # change nothing ----------------------------------------------------------------------
    forge(control.connect(record["address"], record["port"], 30), "outsider",
          {"op": "drain", "host": "127.0.0.1"})
    forge(control.connect(record["address"], record["port"], 30), "worker",
          {"op": "drain", "host": "127.0.0.1"}, secret=control.worker_key(record["secret"]))
    for name in ("outsider", "worker"):
        wait_until(lambda name=name: f"ignored control-store key 'ctl/request/{name}'"
                   in job.output(),
                   f"the driver to ignore the forged request ({name})", 60)
    status = status_of(job, monkeypatch, capsys)
    assert status["hosts"]["drained"] == [] and status["job"]["size"] == 2
    # -- steering: resize down and up, drain, stop -----------------------------------------
    code, out, err = ctl_here(job, monkeypatch, capsys, "resize", "--max-np", "1")
    assert code == 0 and "--max-np is now 1" in out, err
    job.wait_for(lambda: rounds(events) == [2, 1], "a round of 1 worker", 120)
    code, out, err = ctl_here(job, monkeypatch, capsys, "resize", "--max-np", "2")
    assert code == 0, err
    job.wait_for(lambda: rounds(events) == [2, 1, 2], "a round of 2 workers again", 120)
    code, out, err = ctl_here(job, monkeypatch, capsys, "drain", "127.0.0.1")
    assert code == 0 and "draining 127.0.0.1" in out, err
    job.wait_for(lambda: rounds(events) == [2, 1, 2, 1], "the drained host's worker to go", 120)
    status = status_of(job, monkeypatch, capsys)
    assert status["hosts"]["drained"] == ["127.0.0.1"] and status["hosts"]["blacklisted"] == []
    assert [m["host"] for m in status["members"]] == ["localhost"]
    for argv, words in ((["drain", "localhost"], "would leave 0 slots, fewer than --min-np 1"),
                        (["drain", "nohost"], "'nohost' is not one of the job's hosts"),
                        (["resize", "--max-np", "0"], "whole number of at least 1")):
        code, out, err = ctl_here(job, monkeypatch, capsys, *argv)
        assert code == 1 and err.count("\n") == 1 and words in err, (argv, err)
    watcher = subprocess.Popen([sys.executable, "-m", "elastic.ctl", "top", "--interval", "0.2"],
                               env=job.env, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        # top watches before the job stops (started after the stop, it would find no job).
        drawn, _, _ = select.select([watcher.stdout], [], [], 120)
        first = watcher.stdout.readline() if drawn else ""
        assert "elasticctl top" in first, (first, job.output()[-3000:])
        assert ctl(job, "stop").stdout.startswith("stopping")
        assert job.finish(timeout=120) == 128 + signal.SIGTERM, job.output()[-3000:]
        seen, errors = watcher.communicate(timeout=120)     # top sees the job end, and says so
        seen = first + seen
    finally:
        watcher.kill()
    assert watcher.returncode == 0 and "it has ended" in seen.splitlines()[-1], (seen[-500:], errors)
    assert errors == "", errors                              # no C++ warning from the store client
    out = job.output()
    assert "stopped by signal 15: every worker stopped" in out, out[-3000:]
    assert "blacklisting" not in out
    log = [json.loads(line) for line in events.read_text().splitlines()]
    removed = [e["host"] for e in log if e["event"] == "worker_removed"]
    assert removed == ["127.0.0.1", "127.0.0.1"], log    # the resize, then the drain
    assert not [e for e in log if e["event"] in ("host_blacklisted", "worker_failed")]
    assert not os.listdir(job.env[control.ENV_JOBS_DIR])    # the job file went with the job
    assert_no_worker_left(job)
    if not top_ran:
        pytest.skip("everything but `elasticctl top` passed: tmux is not installed (make "
                    "install puts it in with apt-get where it can)")
