"""Bad input to the real ``elasticrun`` CLI: one clear error line, a non-zero exit, no traceback.

Every case runs ``python -m elastic.runner`` as a subprocess.  Each start pays for
``import torch`` (about 1.5 s), so all runs are launched together, a few at a
time, by one module fixture; each test then checks its own run.  Every run has a
deadline, so a hang fails its test instead of stalling the suite.
"""

import os
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 60          # no case may take longer than this
HANG_TIMEOUT_S = 6      # for cases known to hang today (xfail), to keep the file quick
PREFIX = "elasticrun: error:"


# --------------------------------------------------------------------------------------
# The runs.  "{d}" in an argument is replaced by a scratch directory holding the scripts.

SCRIPTS = {
    # name: (text, executable)
    "fails.sh": ("#!/bin/sh\necho 'boom-from-discovery: cluster api down' >&2\nexit 1\n", True),
    "garbage.sh": ("#!/bin/sh\necho '!!!garbage'\n", True),
    "negative.sh": ("#!/bin/sh\necho 'host:-1'\n", True),
    "hangs.sh": ("#!/bin/sh\nsleep 120\n", True),
    "empty.sh": ("#!/bin/sh\nexit 0\n", True),
    "good.sh": ("#!/bin/sh\necho localhost:1\n", True),
    "noexec.sh": ("#!/bin/sh\necho localhost:1\n", False),
    "bad.py": ("def broken(:\n    pass\n", False),
    "plain.py": ("print('plain script done')\n", False),
}


def _case(name, argv, words, timeout=TIMEOUT_S, max_s=None, min_s=None, xfail=None):
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(name, argv, words, timeout, max_s, min_s, id=name, marks=marks)


# (name, argv after "python -m elastic.runner", words the error line must contain)
BAD_INPUT = [
    _case("no_command", ["-np", "1"], ["command"]),
    _case("no_command_after_dashdash", ["-np", "1", "--"], ["command"]),
    _case("np_zero", ["-np", "0", "true"], ["-np", "at least 1"]),
    _case("max_np_zero", ["-np", "1", "--max-np", "0", "true"], ["--max-np"]),
    _case("min_np_above_max_np", ["--min-np", "3", "--max-np", "2", "true"], ["--max-np 2"]),
    _case("np_above_max_np", ["-np", "3", "--max-np", "2", "true"], ["--max-np 2"]),
    _case("no_np", ["true"], ["-np"]),
    _case("np_not_a_number", ["-np", "abc", "true"], ["'abc'"]),
    _case("unknown_flag", ["--no-such-flag", "-np", "1", "true"], ["--no-such-flag"]),
    _case("discovery_script_missing",
          ["-np", "1", "--host-discovery-script", "{d}/no-such-script.sh", "true"],
          ["not found", "no-such-script.sh"]),
    _case("discovery_script_not_executable",
          ["-np", "1", "--host-discovery-script", "{d}/noexec.sh", "true"],
          ["not executable"]),
    _case("discovery_script_is_a_directory",
          ["-np", "1", "--host-discovery-script", "{d}", "true"], ["directory"]),
    _case("discovery_script_exits_1",
          ["-np", "1", "--host-discovery-script", "{d}/fails.sh", "true"],
          ["code 1", "boom-from-discovery: cluster api down"]),
    _case("discovery_script_prints_garbage",
          ["-np", "1", "--host-discovery-script", "{d}/garbage.sh", "true"],
          ["invalid host name", "!!!garbage"]),
    _case("discovery_script_negative_slots",
          ["-np", "1", "--host-discovery-script", "{d}/negative.sh", "true"],
          ["slot", "host:-1"]),
    _case("discovery_script_hangs",
          ["-np", "1", "--discovery-timeout", "1", "--host-discovery-script", "{d}/hangs.sh",
           "true"], ["timed out"], max_s=20),
    _case("discovery_script_finds_nothing",
          ["-np", "1", "--elastic-timeout", "2", "--host-discovery-script", "{d}/empty.sh",
           "true"], ["--elastic-timeout"], min_s=2, max_s=20),
    _case("hosts_and_discovery_script",
          ["-np", "1", "-H", "localhost:1", "--host-discovery-script", "{d}/good.sh", "true"],
          ["only one of"]),
    _case("cooldown_range_reversed", ["-np", "1", "--blacklist-cooldown-range", "5", "1", "true"],
          ["--blacklist-cooldown-range"]),
    _case("cooldown_range_negative", ["-np", "1", "--blacklist-cooldown-range", "-1", "5", "true"],
          ["--blacklist-cooldown-range"]),
    _case("cooldown_range_missing_max", ["-np", "1", "--blacklist-cooldown-range", "5"],
          ["--blacklist-cooldown-range"]),
    _case("command_path_missing", ["-np", "1", "/nonexistent/python", "x.py"],
          ["/nonexistent/python"]),
    _case("command_not_on_path", ["-np", "1", "no-such-cmd-xyz"], ["no-such-cmd-xyz", "PATH"]),
    _case("hosts_zero_slots", ["-np", "1", "-H", "host:0", "true"], ["invalid slot count"]),
    _case("hosts_with_space", ["-np", "1", "-H", "a b", "true"], ["whitespace"]),
    _case("hosts_empty_entry", ["-np", "1", "-H", "localhost:1,", "true"], ["empty host"]),
    _case("hosts_bare_ipv6", ["-np", "1", "-H", "::1:2", "true"], ["brackets"]),
    _case("reset_limit_negative", ["-np", "1", "--reset-limit", "-1", "true"], ["--reset-limit"]),
    _case("repeat_limit_zero", ["-np", "1", "--repeat-limit", "0", "true"], ["--repeat-limit"]),
    _case("warm_spare_with_serve", ["--serve", "-np", "1", "--warm-spare", "true"],
          ["--warm-spare", "--serve"]),
    _case("slots_per_host_zero", ["-np", "1", "--slots-per-host", "0", "true"],
          ["--slots-per-host"]),
    _case("elastic_timeout_zero", ["-np", "1", "--elastic-timeout", "0", "true"],
          ["--elastic-timeout"]),
    _case("discovery_interval_negative", ["-np", "1", "--discovery-interval", "-1", "true"],
          ["--discovery-interval"]),
    _case("log_level_unknown", ["-np", "1", "--log-level", "LOUD", "true"], ["--log-level"]),
    # Known bugs (see the reasons); strict, so a fix turns them into failures to un-mark.
    _case("cooldown_range_infinite",
          ["-np", "1", "--blacklist-cooldown-range", "1", "inf", "true"],
          ["--blacklist-cooldown-range"]),
    _case("elastic_timeout_nan",
          ["-np", "1", "--elastic-timeout", "nan", "--host-discovery-script", "{d}/empty.sh",
           "true"], ["--elastic-timeout"]),
    _case("hosts_empty_string", ["-np", "1", "-H", "", "false"], ["no hosts"]),
]

# Runs that start workers (checked by their own tests below).
RUNTIME = {
    "syntax_error": (["-np", "1", "-H", "localhost:1", "python", "{d}/bad.py"], TIMEOUT_S),
    "plain_script": (["-np", "1", "-H", "localhost:1", "python", "{d}/plain.py"],
                     TIMEOUT_S),
}


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT
    env["OMP_NUM_THREADS"] = "1"
    # `python` in a training command must be this interpreter.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", os.defpath)
    return env


def _run(argv, timeout):
    """Run elasticrun; on a deadline, SIGTERM it (it stops its workers), then SIGKILL."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "elastic.runner", *argv], cwd=ROOT,
                            env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
    return {"rc": proc.returncode, "out": out, "err": err,
            "elapsed": time.monotonic() - start, "timed_out": timed_out}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("elasticrun-cli")
    for name, (text, executable) in SCRIPTS.items():
        path = d / name
        path.write_text(text)
        mode = 0o755 if executable else 0o644
        os.chmod(path, mode)
        assert bool(os.stat(path).st_mode & stat.S_IXUSR) == executable
    jobs = {}
    for param in BAD_INPUT:
        name, argv, _words, timeout, _max, _min = param.values
        jobs[name] = (argv, timeout)
    jobs.update(RUNTIME)
    # Slowest first, so the short usage errors fill in around them.
    order = sorted(jobs, key=lambda n: -jobs[n][1])
    with ThreadPoolExecutor(max_workers=min(8, max(4, os.cpu_count() or 1))) as pool:
        futures = {n: pool.submit(_run, [a.replace("{d}", str(d)) for a in jobs[n][0]],
                                  jobs[n][1]) for n in order}
        return {n: f.result() for n, f in futures.items()}


# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,argv,words,timeout,max_s,min_s", BAD_INPUT)
def test_bad_input_gives_one_error_line(runs, name, argv, words, timeout, max_s, min_s):
    r = runs[name]
    assert not r["timed_out"], f"elasticrun hung for {timeout}s: {r['err'][-2000:]!r}"
    assert "Traceback" not in r["out"] + r["err"], r["err"][-3000:]
    assert r["rc"] not in (0, None), (r["rc"], r["err"])
    lines = [line for line in r["err"].splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one stderr line, got {lines!r}"
    line = lines[0]
    assert line.startswith(PREFIX), line
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    # max_s documents the expected bound; a hang is caught by `timeout` above, and
    # no test asserts on speed (a loaded machine may take longer).
    if min_s is not None:
        assert r["elapsed"] >= min_s, f"gave up after {r['elapsed']:.1f}s, before the timeout"


def test_usage_errors_exit_with_code_2(runs):
    """Command-line mistakes found before the job starts exit 2, like argparse does."""
    for param in BAD_INPUT:
        name = param.values[0]
        if param.marks or name.startswith("discovery_script_") and name not in (
                "discovery_script_missing", "discovery_script_not_executable",
                "discovery_script_is_a_directory"):
            continue    # runtime failures (the script ran) may use another non-zero code
        assert runs[name]["rc"] == 2, (name, runs[name]["err"])


def _driver_lines(r):
    """Lines written by the driver itself: worker output is prefixed "[id]<stream>:"."""
    text = r["out"] + "\n" + r["err"]
    return [line for line in text.splitlines() if line.strip() and not line.startswith("[")]


def test_training_script_with_syntax_error(runs):
    r = runs["syntax_error"]
    assert not r["timed_out"], r["err"][-2000:]
    assert r["rc"] not in (0, None)
    # The worker's own error reaches the user, prefixed with its id.
    assert any(line.startswith("[") and "SyntaxError" in line
               for line in r["err"].splitlines()), r["err"]
    driver = _driver_lines(r)
    errors = [line for line in driver if line.startswith(PREFIX)]
    assert len(errors) == 1, driver
    assert "fail" in errors[0] or "code 1" in errors[0], errors[0]
    assert not any("Traceback" in line for line in driver), driver


def test_script_without_elastic_init_does_not_respawn_forever(runs):
    r = runs["plain_script"]
    assert not r["timed_out"], (
        f"still running after {HANG_TIMEOUT_S}s; "
        f"{r['out'].count('plain script done')} runs of the script")
    assert r["out"].count("plain script done") == 1
    if r["rc"] != 0:
        errors = [line for line in _driver_lines(r) if line.startswith(PREFIX)]
        assert len(errors) == 1
