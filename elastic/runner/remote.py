"""The remote end of a worker started over ssh.

The driver runs ``ssh HOST exec PYTHON -I /same/path/elastic/runner/remote.py``
(no secret on that command line) and writes one line of JSON to the ssh
process's stdin::

    {"command": [...], "cwd": "...", "env": {...}, "secret": "..."}

This program then

* hands the worker the secret on a pipe, whose read end it names in
  ELASTIC_SECRET_FD (ELASTIC_SECRET itself is never set, and nothing is written
  to disk, so nothing is left behind even when this program is SIGKILLed),
* starts the command in its own session, in ``cwd``, with the login
  environment of the remote host updated by ``env``,
* forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to it,
* keeps reading its stdin: end of file means the ssh connection (or the
  driver) is gone, and the worker's whole process group is SIGKILLed at once,
* exits with the worker's code, a death by signal N as 128 + N, so that
  ssh's own 255 keeps meaning "ssh failed" to the driver.

It uses the standard library only and never imports the ``elastic`` package
(which imports torch): it runs with ``-I`` under whatever Python the remote
host has, and assumes the package sits at the same path there (a shared
filesystem, as Horovod assumes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

# The same names as elastic.control (a test checks that they agree).
SECRET_ENV = "ELASTIC_SECRET"
SECRET_FILE_ENV = "ELASTIC_SECRET_FILE"
SECRET_FD_ENV = "ELASTIC_SECRET_FD"
ADDR_ENV = "ELASTIC_STORE_ADDR"

BOOTSTRAP_FAILED = 127       # like a shell that cannot run the command
WEAK_SECRET = 2              # a usage error: the job secret is too short or the example's
MIN_SECRET_BYTES = 16        # elastic.auth's (a test checks that they agree)
EXAMPLE_SECRETS = (b"replace-me-with-openssl-rand-hex-32",)
MAX_SPEC_BYTES = 16 << 20
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
_PR_SET_PDEATHSIG = 1


class SpecError(Exception):
    pass


def read_spec(fd: int = 0) -> dict[str, Any]:
    """Read the first line from ``fd`` and parse it; bytes after it are ignored."""
    buf = bytearray()
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            raise SpecError("the connection closed before the job description arrived")
        buf += chunk
        end = buf.find(b"\n")
        if end >= 0:
            break
        if len(buf) > MAX_SPEC_BYTES:
            raise SpecError("the job description is too large")
    try:
        spec = json.loads(bytes(buf[:end]).decode("utf-8"))
    except ValueError as exc:
        raise SpecError(f"the job description is not valid JSON: {exc}") from None
    command = spec.get("command") if isinstance(spec, dict) else None
    if not (isinstance(command, list) and command and all(isinstance(a, str) for a in command)):
        raise SpecError("the job description has no command")
    env = spec.get("env") or {}
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                          for k, v in env.items())):
        raise SpecError("the job description's env must map strings to strings")
    return spec


def ssh_client_address(environ: Mapping[str, str] | None = None) -> str:
    """The address the driver's ssh connection came from, per sshd's SSH_CONNECTION."""
    fields = (environ if environ is not None else os.environ).get("SSH_CONNECTION", "").split()
    return fields[0] if fields else ""


def build_env(spec: Mapping[str, Any], secret_fd: int,
              environ: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    env.update(spec.get("env") or {})
    env.pop(SECRET_ENV, None)
    env.pop(SECRET_FILE_ENV, None)
    env[SECRET_FD_ENV] = str(secret_fd)
    if not env.get(ADDR_ENV):
        env[ADDR_ENV] = ssh_client_address(environ)
    if spec.get("cwd"):
        env["PWD"] = spec["cwd"]
    return env


def secret_pipe(secret: bytes) -> int:
    """The read end of a pipe that holds ``secret`` (bytes) and then ends."""
    read_end, write_end = os.pipe()
    try:
        view = memoryview(secret)
        while view:
            view = view[os.write(write_end, view):]
    finally:
        os.close(write_end)
    return read_end


def _die_with_parent(parent: int) -> Callable[[], None]:
    """In the child before exec: SIGKILL it when this bootstrap dies (Linux)."""
    def preexec() -> None:
        if sys.platform.startswith("linux"):
            try:
                import ctypes
                ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            except (OSError, AttributeError):
                pass
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
    return preexec


def _kill_group(child: subprocess.Popen[bytes], sig: int) -> None:
    if child.returncode is None:
        try:
            os.killpg(child.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _watch_stdin(child: subprocess.Popen[bytes], fd: int = 0) -> None:
    """End of stdin: the ssh connection or the driver is gone, so is the worker."""
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass
    _kill_group(child, signal.SIGKILL)


def _fail(message: str) -> int:
    sys.stderr.write(f"elasticrun remote ({os.uname().nodename}): {message}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    return BOOTSTRAP_FAILED


def main() -> int:
    try:
        spec = read_spec()
    except (SpecError, OSError) as exc:
        return _fail(str(exc))
    secret = str(spec.get("secret") or "").encode()
    if len(secret.strip()) < MIN_SECRET_BYTES or secret.strip() in EXAMPLE_SECRETS:
        _fail(f"refusing a job secret of {len(secret.strip())} bytes or an example's "
              f"placeholder (at least {MIN_SECRET_BYTES} bytes)")
        return WEAK_SECRET
    secret_fd = secret_pipe(secret)
    try:
        env = build_env(spec, secret_fd)
        # The watcher thread starts after the spawn: preexec_fn needs a lone thread.
        child = subprocess.Popen(
            spec["command"], cwd=spec.get("cwd") or None, env=env,
            stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(secret_fd,),
            preexec_fn=_die_with_parent(os.getpid()))
    except OSError as exc:
        where = f" in {spec.get('cwd')}" if spec.get("cwd") else ""
        return _fail(f"cannot start {spec['command'][0]!r}{where}: {exc.strerror}")
    finally:
        os.close(secret_fd)           # the worker holds its own copy of the read end
    for name in FORWARDED_SIGNALS:
        signal.signal(getattr(signal, name), lambda sig, _f: _kill_group(child, sig))
    threading.Thread(target=_watch_stdin, args=(child,), daemon=True,
                     name="stdin-watch").start()
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The worker is gone: its exit is what the driver waits on (through ssh), so skip the
    # interpreter's teardown (tens of ms on a loaded host, docs/benchmarks.md "Pauses
    # between hosts"). Nothing here is left to clean up: no files, no non-daemon threads.
    os._exit(status)
