"""elasticrun --warm-spare: a started python on the driver's machine, torch imported, forks
each later local worker (elastic/runner/spares.py, elastic/launching/spare.py)."""

import ast
import os
import re
import signal
import sys
import time

import pytest
from support.jobs import REPO, Job, kill_leftover_jobs
from support.procs import environ, job_workers, policies

from elastic.runner.priority import may_return_from_idle
from elastic.runner.spares import Spares, spare_argv


@pytest.fixture
def started():
    jobs = []
    yield jobs
    kill_leftover_jobs(jobs)


def spare_processes():
    """{pid: parent pid} of live processes running launching/spare.py (warm spares, or
    the workers they forked)."""
    found = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if any(a.endswith(b"launching/spare.py") for a in argv):
                with open(f"/proc/{name}/stat") as f:
                    found[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return found


def spares_of(out):
    """Those started for the job writing ``out``."""
    found = []
    for pid in spare_processes():
        try:
            if environ(pid).get("JOB_OUT") == str(out):
                found.append(pid)
        except OSError:
            continue
    return found


def test_only_a_python_script_command_can_use_a_spare(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    assert spare_argv([sys.executable, str(script), "--lr", "1"]) == (
        sys.executable, [str(script), "--lr", "1"])
    assert spare_argv(["python3", "-u", str(script)])[1] == [str(script)]
    assert spare_argv([sys.executable, "-m", "train"]) is None
    assert spare_argv([sys.executable, "-c", "print(1)"]) is None
    assert spare_argv([sys.executable, str(tmp_path / "missing.py")]) is None
    assert spare_argv(["/bin/sh", str(script)]) is None


def import_time_env_reads(source):
    """Statements of ``source`` that run at import (module and class bodies) and read the
    environment."""
    found = []

    def visit(body):
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Import,
                                   ast.ImportFrom)):
                continue
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue                                 # a docstring
            elif "environ" in (text := ast.unparse(node)) or "getenv" in text:
                found.append(text[:80])

    visit(ast.parse(source).body)
    return found


def test_no_elastic_module_reads_the_environment_at_import():
    """A spare imports elastic before it has the worker's environment (spare.py)."""
    assert import_time_env_reads('"""environ"""\nimport os\nX = os.environ.get("A")\n'
                                 'class K:\n    Y = os.getenv("B")\n    def f(self):\n'
                                 '        return os.environ\n') == [
        "X = os.environ.get('A')", "Y = os.getenv('B')"]
    found = [f"{path.relative_to(REPO)}: {line}"
             for path in sorted((REPO / "elastic").rglob("*.py"))
             for line in import_time_env_reads(path.read_text())]
    assert found == []


def test_the_spare_imports_idle_then_forks_workers_and_reports_their_exit_codes(tmp_path):
    script = tmp_path / "work.py"
    script.write_text("import os, sys, time\nprint(os.environ['SAY'], flush=True)\n"
                      "time.sleep(float(os.environ['SLEEP']))\nsys.exit(int(os.environ['CODE']))\n")
    spares = Spares([sys.executable, str(script)])
    spares.note_worker(dict(os.environ, OMP_NUM_THREADS="1", ELASTIC_WORKER_ID="7"))
    assert spares.refill()
    try:
        deadline = time.monotonic() + 60
        while not children_running_the_spare(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.01)
        (spare,) = children_running_the_spare(os.getpid())
        assert "ELASTIC_WORKER_ID" not in environ(spare)
        # It imports torch for seconds, at SCHED_IDLE where it may come back from it.
        idle = os.SCHED_IDLE if may_return_from_idle() else os.SCHED_OTHER
        assert policies(spare) == {idle}
        # A worker asked of it before it is ready: it imports at full speed, then forks.
        first = spares.take(dict(os.environ, SAY="first", SLEEP="0", CODE="3"))
        assert policies(spare) == {os.SCHED_OTHER}
        assert first.stdout.readline() == b"first\n"
        assert first.wait(timeout=60) == 3                 # its exit code, from the spare
        second = spares.take(dict(os.environ, SAY="second", SLEEP="600", CODE="0"))
        assert second.stdout.readline() == b"second\n"
        deadline = time.monotonic() + 60
        while second.poll() is None and not second.pid and time.monotonic() < deadline:
            time.sleep(0.01)                               # the spare's word on its pid
        assert spare_processes().get(second.pid) == spare   # forked: the spare's child
        assert policies(second.pid) == {os.SCHED_OTHER}
        second.kill()
        assert second.wait(timeout=60) == -signal.SIGKILL
    finally:
        spares.close()
    assert children_running_the_spare(os.getpid()) == []


FORKED = re.compile(r"worker (\S+) on (\S+): the warm spare forks it")


def test_crashed_workers_are_forked_by_the_warm_spare_and_nothing_is_lost(tmp_path, started):
    job = Job(tmp_path, ["-np", "2", "--max-np", "2", "--warm-spare",
                         "--blacklist-cooldown-range", "1", "2"],
              hosts=["localhost:1", "127.0.0.1:1", "127.0.0.2:1"], env={"JOB_HOLD": "3"}).start()
    started.append(job)
    job.wait_step(3, size=2)
    driver = job.proc.pid
    job.wait_for(lambda: children_running_the_spare(driver), "a warm spare")
    (spare,) = children_running_the_spare(driver)
    assert spares_of(job.out) == [spare]
    env = environ(spare)
    assert not [k for k in env if k.startswith("ELASTIC_")], env    # no id, rank or key
    victim = next(pid for pid, e in job_workers(job.out).items()
                  if e["ELASTIC_HOSTNAME"] == "localhost")
    os.kill(victim, signal.SIGKILL)
    job.wait_for(lambda: FORKED.search(job.output()), "the spare to fork the replacement")
    wid, host = FORKED.search(job.output()).groups()
    job.wait_for(lambda: any(r["worker"] == wid for r in job.steps()), "the forked worker trains")
    (pid,) = children_running_the_spare(spare)                 # the spare's child
    assert policies(pid) == {os.SCHED_OTHER}                   # a worker never runs idle
    # Its exit code comes through the spare: a SIGKILL reads as -9, and the spare forks
    # the next replacement too.
    os.kill(pid, signal.SIGKILL)
    job.wait_for(lambda: f"worker {wid} on {host} exited with code -9" in job.output(),
                 "the forked worker's exit code")
    job.wait_for(lambda: len(FORKED.findall(job.output())) == 2, "a second fork")
    job.release(3)
    job.assert_ok(job.finish(), final_size=2)
    second = FORKED.findall(job.output())[1][0]
    assert any(r["worker"] == second for r in job.steps())
    deadline = time.monotonic() + 30
    while spares_of(job.out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert spares_of(job.out) == []                      # the spare went with the job


def children_running_the_spare(parent):
    return [pid for pid, ppid in spare_processes().items() if ppid == parent]


def test_a_joining_agent_keeps_a_spare_for_its_host(join_job):
    job = join_job(["-np", "2", "--min-np", "1", "--worker-timeout", "10",
                    "--blacklist-cooldown-range", "1", "2"], env={"JOB_HOLD": "3,8"}).start()
    agent = job.join("node-a", extra=["--warm-spare"])
    job.join("node-b")
    job.wait_step(3, size=2)
    job.wait_for(lambda: children_running_the_spare(agent.pid), "node-a's warm spare")
    (spare,) = children_running_the_spare(agent.pid)
    assert not [k for k in environ(spare) if k.startswith("ELASTIC_")]
    (victim,) = [pid for pid, e in job_workers(job.out).items()
                 if e["ELASTIC_HOSTNAME"] == "node-a"]
    os.kill(victim, signal.SIGKILL)
    job.wait_for(lambda: "the warm spare forks it" in job.agent_output("node-a"),
                 "node-a's spare to fork the replacement after the cooldown")
    job.wait_for(lambda: children_running_the_spare(spare), "the worker the spare forked")
    job.release(3)
    job.wait_for(lambda: re.search(r"round \d+: 2 workers \(\+1 on node-a\)", job.output()),
                 "the replacement to join")
    job.release(8)
    job.assert_ok(job.finish(), final_size=2)
    assert job.wait_agent("node-a") == 0
    assert children_running_the_spare(agent.pid) == []
