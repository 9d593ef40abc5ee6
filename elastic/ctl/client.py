"""elasticctl's end of the control store: find the job, send a sealed request, read
the sealed answer (runner/steering.py is the driver's end)."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from elastic.exceptions import ElasticError
from elastic.protocol import ENV_SECRET_FILE, ControlStore, Doorbell, Keys, connect, ctl_key
from elastic.runner import jobfiles, serve

T = TypeVar("T")
RERING_S = 1.0           # a request whose ring was lost (the inbox was emptied) rings again
POLL_S = 0.05


class CtlError(ElasticError):
    """elasticctl cannot do what was asked; str() is the one line it prints."""


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """torch's store client writes a C++ warning with a stack to fd 2 when it cannot
    connect or the job's store goes away; elasticctl says so in one line of its own."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass(frozen=True)
class Target:
    address: str
    port: int
    secret: str
    label: str             # how messages name the job


def parse_addr(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CtlError(f"--addr {text!r} is not HOST:PORT")
    return host, int(port)


def find_target(job: int | None = None, addr: str | None = None,
                secret_file: str | None = None,
                environ: Mapping[str, str] | None = None) -> Target:
    """The job to talk to: ``--addr`` with its secret, else a job file on this machine."""
    env = os.environ if environ is None else environ
    if addr:
        host, port = parse_addr(addr)
        path = secret_file or env.get(ENV_SECRET_FILE)
        if not path:
            raise CtlError("--addr needs the job secret: --secret-file FILE "
                           f"(or {ENV_SECRET_FILE})")
        try:
            secret = serve.read_secret(path)
        except ValueError as exc:
            raise CtlError(str(exc)) from None
        return Target(host, port, secret, f"{host}:{port}")
    directory = jobfiles.jobs_dir(env)
    jobs = jobfiles.running(directory)
    if job is not None:
        jobs = [r for r in jobs if r["pid"] == job]
        if not jobs:
            raise CtlError(f"no running elasticrun job with pid {job} (job files: {directory})")
    if not jobs:
        raise CtlError(f"no running elasticrun job found (job files: {directory}); for a job "
                       "on another machine give --addr HOST:PORT --secret-file FILE")
    if len(jobs) > 1:
        pids = ", ".join(str(r["pid"]) for r in jobs)
        raise CtlError(f"{len(jobs)} jobs are running here (pids {pids}): choose one with "
                       "--job PID")
    record = jobs[0]
    try:
        return Target(record["address"], int(record["port"]), record["secret"],
                      f"pid {record['pid']}")
    except (KeyError, TypeError, ValueError):
        raise CtlError(f"the job file of pid {record['pid']} in {directory} is damaged") from None


class Client:
    """One connection to a job's control store, holding its secret."""

    def __init__(self, target: Target, timeout: float = 10.0) -> None:
        self.target, self.timeout = target, timeout
        where = f"{target.address}:{target.port}"
        try:                         # a plain connect first: a refusal is told at once
            socket.create_connection((target.address, target.port), timeout=timeout).close()
        except OSError as exc:
            raise CtlError(f"cannot reach the job's control store at {where} "
                           f"({exc.strerror or 'timed out'}; has the job ended?)") from None
        try:
            with quiet_stderr():
                store = connect(target.address, target.port, timeout)
        except (RuntimeError, OSError) as exc:
            raise CtlError(f"cannot reach the job's control store at {where} "
                           f"({' '.join(str(exc).split())[:160]})") from None
        # Requests and answers are sealed with elasticctl's own key, derived from the job
        # secret (the job file's or --secret-file's); workers hold only their own key.
        self.control = ControlStore(store, ctl_key(target.secret), warn=lambda message: None)
        if self._get(Keys.CTL_HELLO) is None:
            raise CtlError(f"no elasticrun job with this secret answers at {target.address}:"
                           f"{target.port} (wrong secret, or not an elasticrun control store)")

    def _store(self, call: Callable[..., T], *args: Any) -> T:
        try:
            with quiet_stderr():
                return call(*args)
        except (RuntimeError, OSError):
            raise CtlError(f"lost the job ({self.target.label}): it has ended") from None

    def _get(self, key: str) -> Any:
        return self._store(self.control.get, key)

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        """The driver's answer to one request; CtlError when it refuses or is gone."""
        name = secrets.token_hex(12)
        key, reply_key = Keys.ctl_request(name), Keys.ctl_reply(name)
        bell = Doorbell(self.control, Keys.CTL_INBOX)
        self._store(self.control.put, key, dict(args, op=op))
        self._store(bell.ring, name)
        started = rung = time.monotonic()
        while True:
            reply = self._get(reply_key)
            if reply is not None:
                break
            now = time.monotonic()
            if now - started > self.timeout:
                raise CtlError(f"the job ({self.target.label}) did not answer within "
                               f"{self.timeout:g} s")
            if now - rung >= RERING_S:
                rung = now
                self._store(bell.ring, name)
            time.sleep(POLL_S)
        with contextlib.suppress(CtlError):
            self._store(self.control.delete, reply_key)
        if not reply.get("ok"):
            raise CtlError(str(reply.get("error") or "the driver refused"))
        return reply
