"""Spawn requests cannot choose an agent's loader or interpreter (spawn_env.py): the
agent drops LD_*, PYTHON* and the like from a request unless its allow-list names
them. Real agent, real worker process, its real environment."""

import json
import sys
import time

from elastic.runner import spawn_env
from elastic.runner.agent import Agent, AgentConfig

DUMP = ("import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))")


def _spawned_env(tmp_path, request_env):
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    out = tmp_path / "env.json"
    agent = Agent(AgentConfig(driver_host="127.0.0.1", driver_port=1, secret_file=str(secret),
                              command=[sys.executable, "-c", DUMP, str(out)], host_name="node-a",
                              quiet=True))
    agent.spawn_worker("7", request_env)
    deadline = time.monotonic() + 60
    while agent.workers["7"].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent.workers["7"].poll() == 0
    return json.loads(out.read_text())


HOSTILE = {"LD_PRELOAD": "/tmp/evil.so", "LD_LIBRARY_PATH": "/tmp/evil",
           "PYTHONPATH": "/tmp/evil", "PYTHONSTARTUP": "/tmp/evil.py", "BASH_ENV": "/tmp/x",
           "PATH": "/tmp/evil", "JOB_SETTING": "kept", "PYTHONUNBUFFERED": "0"}


def test_a_spawn_request_cannot_set_loader_or_interpreter_variables(tmp_path, monkeypatch):
    monkeypatch.delenv(spawn_env.ENV_ALLOW, raising=False)
    env = _spawned_env(tmp_path, HOSTILE)
    assert env["JOB_SETTING"] == "kept"
    for name in ("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONSTARTUP", "BASH_ENV"):
        assert env.get(name) != HOSTILE[name], name
    assert env["PATH"] != "/tmp/evil"
    assert env["PYTHONUNBUFFERED"] == "1"        # the agent's own, not the request's


def test_an_explicit_allow_list_lets_named_variables_through(tmp_path, monkeypatch):
    monkeypatch.setenv(spawn_env.ENV_ALLOW, "PYTHONPATH, LD_*")
    env = _spawned_env(tmp_path, HOSTILE)
    assert env["PYTHONPATH"] == "/tmp/evil" and env["LD_LIBRARY_PATH"] == "/tmp/evil"
    assert env.get("PYTHONSTARTUP") != "/tmp/evil.py"      # not on the list


def test_split_drops_odd_names_and_reports_what_it_dropped():
    kept, dropped = spawn_env.split({"A": 1, "LD_AUDIT": "x", "": "y", "B=C": "z",
                                     "PYTHONHOME": "/x", "GLIBC_TUNABLES": "t"})
    assert kept == {"A": "1"}
    assert dropped == ["GLIBC_TUNABLES", "LD_AUDIT", "PYTHONHOME"]
