import os
import stat
import time

import pytest

from elastic.runner.discovery import (
    BackgroundDiscovery,
    DiscoveryError,
    DiscoveryResult,
    FixedDiscovery,
    ScriptDiscovery,
    parse_host_list,
    parse_hosts,
)

# --------------------------------------------------------------------------
# parse_hosts

VALID = [
    ("", {}),
    ("\n\n   \n", {}),
    ("# only a comment\n", {}),
    ("node1", {"node1": 1}),
    ("node1:4\nnode2:2\n", {"node1": 4, "node2": 2}),
    ("  node1:4  \n\n node2 \n", {"node1": 4, "node2": 1}),
    ("node1:2 # trailing comment\n# whole line\nnode2", {"node1": 2, "node2": 1}),
    ("10.0.0.1:8\n10.0.0.2", {"10.0.0.1": 8, "10.0.0.2": 1}),
    ("[::1]\n[fe80::1]:4", {"::1": 1, "fe80::1": 4}),
    ("host-a.example.com:3\nhost_b", {"host-a.example.com": 3, "host_b": 1}),
    ("node1:010", {"node1": 10}),
    ("node1\r\nnode2:2\r\n", {"node1": 1, "node2": 2}),
]


@pytest.mark.parametrize("text,expected", VALID)
def test_parse_valid(text, expected):
    assert parse_hosts(text) == expected


def test_parse_preserves_order():
    assert list(parse_hosts("c\na\nb\n")) == ["c", "a", "b"]


def test_parse_default_slots():
    assert parse_hosts("a\nb:2", default_slots=8) == {"a": 8, "b": 2}


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_parse_rejects_bad_default_slots(bad):
    with pytest.raises(ValueError):
        parse_hosts("a", default_slots=bad)


INVALID = [
    # (text, line number, fragment of the message)
    ("node1:0", 1, "invalid slot count '0'"),
    ("ok\nok2\nnode1:-2", 3, "invalid slot count '-2' in 'node1:-2'"),
    ("node1:x", 1, "invalid slot count 'x'"),
    ("node1:2.5", 1, "invalid slot count '2.5'"),
    ("node1:", 1, "invalid slot count ''"),
    ("node1:+3", 1, "invalid slot count '+3'"),
    ("a\n::1", 2, "must be in brackets"),
    ("fe80::1:4", 1, "must be in brackets"),
    ("node 1", 1, "whitespace"),
    ("node1 :2", 1, "whitespace"),
    (":4", 1, "empty host"),
    ("[]:4", 1, "empty host"),
    ("a\nb\na:2", 3, "duplicate host 'a'"),
    ("Node1\nnode1", 2, "duplicate host"),
    ("[::1]\n[0::1]", 2, "duplicate host"),
    ("[::1", 1, "unterminated"),
    ("[::1]4", 1, "after ']'"),
    ("[nothex]:2", 1, "invalid IPv6 address"),
    ("node/1", 1, "invalid host name"),
    ("n@de", 1, "invalid host name"),
    ("-node1", 1, "must start with"),
    ("-oProxyCommand=x", 1, "invalid host name"),
    ("a:1:2", 1, "must be in brackets"),
]


@pytest.mark.parametrize("text,line,fragment", INVALID)
def test_parse_invalid(text, line, fragment):
    with pytest.raises(DiscoveryError) as info:
        parse_hosts(text)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"discovery script: line {line}: ")
    assert fragment in message


def test_parse_invalid_names_source():
    with pytest.raises(DiscoveryError, match=r"^my.sh: line 1: "):
        parse_hosts("bad host", source="my.sh")


def test_parse_error_message_truncated():
    with pytest.raises(DiscoveryError) as info:
        parse_hosts("x" * 5000 + ":0")
    assert len(str(info.value)) <= 300


def test_discovery_error_is_one_line():
    err = DiscoveryError("first\nsecond\n\n  third\t" + "y" * 1000)
    assert "\n" not in str(err)
    assert str(err).startswith("first second third y")
    assert len(str(err)) <= 300


# --------------------------------------------------------------------------
# parse_host_list

def test_host_list():
    assert parse_host_list("host1:2,host2,[::1]:3") == {"host1": 2, "host2": 1, "::1": 3}
    assert parse_host_list(" a , b:2 ") == {"a": 1, "b": 2}


@pytest.mark.parametrize("arg,fragment", [
    ("", "no hosts"),
    ("a,,b", "-H: entry 2: empty host"),
    ("a,", "-H: entry 2: empty host"),
    ("a:0", "-H: entry 1: invalid slot count"),
    ("a,a", "-H: entry 2: duplicate host"),
    ("::1:2", "must be in brackets"),
])
def test_host_list_invalid(arg, fragment):
    with pytest.raises(DiscoveryError) as info:
        parse_host_list(arg)
    assert fragment in str(info.value)


# --------------------------------------------------------------------------
# ScriptDiscovery

def write_script(tmp_path, body, name="discover.sh", executable=True):
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    if executable:
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_script_ok(tmp_path):
    path = write_script(tmp_path, "echo node1:2\necho '# c'\necho node2\n")
    d = ScriptDiscovery(path, default_slots=4)
    d.validate()
    assert d.discover() == {"node1": 2, "node2": 4}
    assert d.run_once() == {"node1": 2, "node2": 4}


def test_script_empty_output(tmp_path):
    assert ScriptDiscovery(write_script(tmp_path, "exit 0\n")).discover() == {}


def test_script_nonzero_exit(tmp_path):
    path = write_script(tmp_path, "echo node1\necho 'cannot reach' >&2\necho 'the API' >&2\nexit 3\n")
    with pytest.raises(DiscoveryError) as info:
        ScriptDiscovery(path).discover()
    message = str(info.value)
    assert "\n" not in message
    assert "exited with code 3" in message
    assert "cannot reach the API" in message


def test_script_nonzero_exit_long_stderr_keeps_tail(tmp_path):
    path = write_script(tmp_path, "i=0; while [ $i -lt 200 ]; do echo noise >&2; i=$((i+1)); done\n"
                                  "echo 'FinalError: boom' >&2; exit 1\n")
    with pytest.raises(DiscoveryError) as info:
        ScriptDiscovery(path).discover()
    assert "FinalError: boom" in str(info.value)
    assert len(str(info.value)) <= 300


def test_script_not_executable(tmp_path):
    path = write_script(tmp_path, "echo a\n", executable=False)
    d = ScriptDiscovery(path)
    with pytest.raises(DiscoveryError, match="not executable"):
        d.validate()
    with pytest.raises(DiscoveryError, match="not executable"):
        d.discover()


def test_script_missing(tmp_path):
    d = ScriptDiscovery(tmp_path / "nope.sh")
    with pytest.raises(DiscoveryError, match="not found"):
        d.validate()
    with pytest.raises(DiscoveryError, match="not found"):
        d.discover()


def test_script_directory(tmp_path):
    with pytest.raises(DiscoveryError, match="directory"):
        ScriptDiscovery(tmp_path).validate()


def test_script_bad_output(tmp_path):
    path = write_script(tmp_path, "echo node1\necho 'node2:zero'\n")
    with pytest.raises(DiscoveryError) as info:
        ScriptDiscovery(path).discover()
    assert f"discovery script {path}: line 2: invalid slot count 'zero'" in str(info.value)


def test_script_without_interpreter(tmp_path):
    path = tmp_path / "noshebang"
    path.write_bytes(b"\x00\x01garbage")
    path.chmod(0o755)
    with pytest.raises(DiscoveryError, match="cannot run"):
        ScriptDiscovery(path).discover()


def test_script_timeout(tmp_path):
    path = write_script(tmp_path, "exec sleep 30\n")
    start = time.monotonic()
    with pytest.raises(DiscoveryError, match="timed out after 1s"):
        ScriptDiscovery(path, timeout=1.0).discover()
    assert time.monotonic() - start < 5


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of the (now dead) script may linger as a zombie until
    # init reaps it; that still counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_script_with_hanging_child(tmp_path):
    pidfile = tmp_path / "child.pid"
    # The child inherits stdout, so waiting for EOF alone would hang.
    path = write_script(tmp_path, f"sleep 30 &\necho $! > {pidfile}\necho node1\nwait\n")
    start = time.monotonic()
    with pytest.raises(DiscoveryError, match="timed out"):
        ScriptDiscovery(path, timeout=1.0).discover()
    assert time.monotonic() - start < 5
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 3
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_script_exits_but_child_holds_output(tmp_path):
    path = write_script(tmp_path, "sleep 30 &\necho node1\nexit 0\n")
    start = time.monotonic()
    with pytest.raises(DiscoveryError, match="child process kept its output open"):
        ScriptDiscovery(path, timeout=1.0).discover()
    assert time.monotonic() - start < 5


def test_script_rejects_bad_timeout(tmp_path):
    with pytest.raises(ValueError):
        ScriptDiscovery(tmp_path / "x", timeout=0)


# --------------------------------------------------------------------------
# FixedDiscovery

def test_fixed_returns_copy():
    d = FixedDiscovery({"a": 2})
    first = d.discover()
    first["b"] = 1
    assert d.discover() == {"a": 2}


# --------------------------------------------------------------------------
# BackgroundDiscovery

def wait_for(bg, count, timeout=5.0):
    results = []
    deadline = time.monotonic() + timeout
    while len(results) < count and time.monotonic() < deadline:
        results.extend(bg.poll())
        time.sleep(0.01)
    return results


def test_background_delivers_results():
    bg = BackgroundDiscovery(FixedDiscovery({"a": 1}), interval=0.01)
    bg.start()
    try:
        results = wait_for(bg, 3)
    finally:
        assert bg.stop()
    assert len(results) >= 3
    assert all(r == DiscoveryResult({"a": 1}, None, r.at) for r in results)
    assert [r.at for r in results] == sorted(r.at for r in results)
    bg.poll()  # drain anything delivered just before stop()
    time.sleep(0.05)
    assert bg.poll() == []  # stopped: nothing new arrives


def test_background_reports_errors_and_keeps_going():
    class Flaky:
        calls = 0

        def discover(self):
            self.calls += 1
            if self.calls == 1:
                raise DiscoveryError("script broke")
            if self.calls == 2:
                raise RuntimeError("bug\nin discoverer")
            return {"h": 2}

    bg = BackgroundDiscovery(Flaky(), interval=0.01)
    bg.start()
    try:
        results = wait_for(bg, 3)
    finally:
        bg.stop()
    assert results[0].hosts is None and results[0].error == "script broke"
    assert results[1].error == "RuntimeError: bug in discoverer"
    assert results[2].hosts == {"h": 2} and results[2].error is None


def test_background_poll_is_nonblocking_while_script_runs(tmp_path):
    path = write_script(tmp_path, "sleep 2\necho a\n")
    bg = BackgroundDiscovery(ScriptDiscovery(path), interval=10)
    bg.start()
    try:
        start = time.monotonic()
        assert bg.poll() == []
        assert time.monotonic() - start < 0.5
        results = wait_for(bg, 1)
        assert results[0].hosts == {"a": 1}
    finally:
        assert bg.stop()


def test_background_stop_is_prompt_during_interval():
    bg = BackgroundDiscovery(FixedDiscovery({}), interval=60)
    bg.start()
    assert wait_for(bg, 1)[0].hosts == {}
    start = time.monotonic()
    assert bg.stop(timeout=2)
    assert time.monotonic() - start < 1


def test_background_start_twice():
    bg = BackgroundDiscovery(FixedDiscovery({}), interval=1)
    bg.start()
    try:
        with pytest.raises(RuntimeError):
            bg.start()
    finally:
        bg.stop()


def test_background_rejects_bad_interval():
    with pytest.raises(ValueError):
        BackgroundDiscovery(FixedDiscovery({}), interval=0)
