"""A client connection to the driver's store that heals (docs/failure-model.md).

A TCPStore client never reconnects: once a NAT gateway, a conntrack flush or a
load balancer's idle timeout resets its socket, every later call fails with
"Broken pipe". Workers touch their connection rarely (ranks other than 0 only
at membership changes), so an idle-dropped flow would otherwise end a worker
exactly when the job needs it. A ``HealingStore`` forwards each call to its
current TCPStore client and, when one fails with a network error, makes a new
client and calls again: with backoff, for at most ``reconnect_within_s``, with
one warning per address and minute. Store calls are requests that may simply
be repeated (a set, a read, a check); an append may land twice, which the
doorbell's readers tolerate (each name is verified against its sealed key).

TCP keepalive is switched on for every client socket: the TCPStore does not
expose its socket, so the socket is found among this process's descriptors by
its peer address (keepalive_to) and the options are set on a duplicate of it.

Torch's C++ side logs a warning with a C++ stack trace for every failed store call
(and every failed reconnect attempt), tens of lines each, before the error reaches
us. So a process that opens a healing connection raises c10's log level to ERROR
(quiet_cpp_warnings), as TORCH_CPP_LOG_LEVEL=ERROR would at start: a reset then
shows as our one warning line. torch reads that variable only when it is imported,
before our code runs, so the level is set in the loaded library; a user who sets
TORCH_CPP_LOG_LEVEL keeps their own choice.
"""

from __future__ import annotations

import ctypes
import glob
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

# A test on (local, peer) addresses, each as (host, port).
AddressTest = Callable[[tuple[str, int], tuple[str, int]], bool]

RECONNECT_WITHIN_S = 120.0     # how long a call keeps trying to reach the store again
KEEPALIVE_IDLE_S = 60          # well below kube-proxy's 900 s and cloud LBs' 350 s
KEEPALIVE_INTERVAL_S = 15
KEEPALIVE_PROBES = 4
WARN_EVERY_S = 60.0
_BACKOFF_MAX_S = 2.0

_warned: dict[str, float] = {}
_warned_lock = threading.Lock()
_CPP_ERROR_LEVEL = 2           # c10's levels: 0 info, 1 warning, 2 error, 3 fatal
_quieted: list[bool] = []


def quiet_cpp_warnings(environ: Mapping[str, str] = os.environ) -> bool:
    """Raise c10's log level to ERROR in this process, once, unless the user chose a
    level (TORCH_CPP_LOG_LEVEL). Returns whether the level is ERROR or above now."""
    if "TORCH_CPP_LOG_LEVEL" in environ:
        return False
    if not _quieted:
        _quieted.append(_set_cpp_log_level(_CPP_ERROR_LEVEL))
    return _quieted[0]


def _set_cpp_log_level(level: int) -> bool:
    """Set FLAGS_caffe2_log_level in the loaded libc10 (False where it is not found)."""
    import torch
    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*")):
        try:
            flag = ctypes.c_int.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level")
        except (OSError, ValueError):
            continue
        flag.value = max(flag.value, level)
        return True
    return False


def _warn_once(where: str, message: str, warn: Callable[[str], None]) -> None:
    now = time.monotonic()
    with _warned_lock:
        if now - _warned.get(where, -WARN_EVERY_S) < WARN_EVERY_S:
            return
        _warned[where] = now
    warn(message)


def set_keepalive(sock: socket.socket) -> None:
    """TCP keepalive on ``sock`` (a dead or idle-dropped peer shows within minutes)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _socket_fds() -> list[int]:
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    fds = []
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.append(int(name))
        except (OSError, ValueError):
            continue
    return fds


def _matching(fd: int, want: AddressTest) -> socket.socket | None:
    """Whether ``fd`` is a TCP socket for which ``want(local, peer)`` holds."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if dup.type != socket.SOCK_STREAM or dup.family not in (socket.AF_INET, socket.AF_INET6):
            dup.close()
            return None
        try:
            local, peer = dup.getsockname(), dup.getpeername()
        except OSError:
            dup.close()
            return None
        if want(local[:2], peer[:2]):
            return dup
    except OSError:
        pass
    dup.close()
    return None


def _same_port(port: int | str) -> AddressTest:
    return lambda local, peer: int(peer[1]) == int(port)


def keepalive_where(want: AddressTest) -> int:
    """Keepalive on each of this process's TCP sockets for which ``want(local, peer)``
    holds (addresses as (host, port)); returns how many it set. Linux only (/proc)."""
    count = 0
    for fd in _socket_fds():
        dup = _matching(fd, want)
        if dup is None:
            continue
        try:
            set_keepalive(dup)
            count += 1
        except OSError:
            pass
        finally:
            dup.close()
    return count


def keepalive_to(port: int) -> int:
    """Keepalive on this process's connections to a store at ``port`` (any address:
    the peer may show as an IPv4-mapped IPv6 address)."""
    return keepalive_where(_same_port(port))


def keepalive_accepted(port: int) -> int:
    """Keepalive on the connections a store listening on ``port`` accepted."""
    return keepalive_where(lambda local, peer: int(local[1]) == int(port) and peer[1] != 0)


def keepalive_enabled(sock_fd: int) -> bool:
    """Whether SO_KEEPALIVE is set on ``sock_fd`` (tests read it)."""
    dup = socket.socket(fileno=os.dup(sock_fd))
    try:
        return bool(dup.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE))
    finally:
        dup.close()


def driver_refuses(addr: str, port: int | str, timeout_s: float = 2.0) -> bool:
    """True when ``addr`` answers but nothing listens on ``port`` (the driver is gone);
    False when it accepts, or does not answer at all (a network problem)."""
    try:
        with socket.create_connection((addr, int(port)), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class StoreCalls(Protocol):
    """The store calls elastic makes on a connection to the driver's store: a
    HealingStore, or torch's PrefixStore over a plain TCPStore client (whose stubs lack
    ``append`` and ``multi_set`` and take str values only, though bytes work)."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def multi_set(self, keys: list[str], values: list[bytes]) -> None: ...
    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes: ...
    def append(self, key: str, value: str | bytes) -> None: ...
    def delete_key(self, key: str) -> bool: ...
    def list_keys(self) -> list[str]: ...
    def num_keys(self) -> int: ...


class _Connection:
    """The current TCPStore client to one address, remade when it breaks."""

    def __init__(self, addr: str, port: int | str, timeout_s: float) -> None:
        quiet_cpp_warnings()
        self.addr, self.port, self.timeout_s = addr, int(port), float(timeout_s)
        self.lock = threading.Lock()
        self.generation = 0
        self.store = self._open(self.timeout_s)
        self.reconnects = 0

    def _open(self, timeout_s: float) -> dist.TCPStore:
        store = dist.TCPStore(self.addr, self.port, is_master=False,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                              use_libuv=True)
        keepalive_to(self.port)
        return store

    def reopen(self, failed_generation: int, deadline: float, warn: Callable[[str], None],
               error: Exception) -> None:
        """A fresh client (unless another thread made one already), by ``deadline``."""
        with self.lock:
            if self.generation != failed_generation:
                return
            where = f"{self.addr}:{self.port}"
            _warn_once(where, f"the connection to the control store at {where} broke "
                              f"({str(error).splitlines()[0][:120]}); reconnecting for at most "
                              f"{RECONNECT_WITHIN_S:.0f} s", warn)
            pause = 0.05
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise error
                try:
                    self.store = self._open(max(1.0, min(self.timeout_s, left)))
                    self.generation += 1
                    self.reconnects += 1
                    return
                except (dist.DistError, RuntimeError):
                    time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                    pause = min(pause * 2, _BACKOFF_MAX_S)


def _stderr(message: str) -> None:
    import sys
    sys.stderr.write(f"elastic: warning: {message}\n")
    sys.stderr.flush()


class HealingStore:
    """The store's calls (optionally under a key prefix) over a connection that heals.

    ``reconnect_within_s`` = 0 makes a failed call raise at once (the heartbeat makes a
    new connection itself: its own loop decides when the driver is gone).
    """

    def __init__(self, addr: str, port: int | str, timeout_s: float,
                 reconnect_within_s: float = RECONNECT_WITHIN_S,
                 warn: Callable[[str], None] = _stderr, *, _conn: _Connection | None = None,
                 _prefix: str = "") -> None:
        self._conn = _conn or _Connection(addr, port, timeout_s)
        self._prefix = _prefix
        self._within = float(reconnect_within_s)
        self._warn = warn
        self._view: tuple[int, dist.Store] | None = None   # (generation, the store or PrefixStore over it)

    def with_prefix(self, prefix: str) -> HealingStore:
        """The same connection, every key under ``prefix``."""
        conn = self._conn
        return HealingStore(conn.addr, conn.port, conn.timeout_s, self._within, self._warn, _conn=conn,
                            _prefix=self._prefix + prefix)

    @property
    def reconnects(self) -> int:
        return self._conn.reconnects

    @property
    def port(self) -> int:
        return self._conn.port

    def _current(self) -> tuple[int, dist.Store]:
        conn = self._conn
        view = self._view
        if view is None or view[0] != conn.generation:
            store = conn.store
            view = (conn.generation,
                    dist.PrefixStore(self._prefix, store) if self._prefix else store)
            self._view = view
        return view

    def _call(self, name: str, *args: Any) -> Any:
        deadline: float | None = None
        while True:
            generation, store = self._current()
            try:
                return getattr(store, name)(*args)
            except dist.DistNetworkError as exc:
                if self._within <= 0:
                    raise             # the caller makes a new connection when it wants one
                if deadline is None:
                    deadline = time.monotonic() + self._within
                self._conn.reopen(generation, deadline, self._warn, exc)

    # -- the Store calls elastic makes ----------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        return self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", keys)

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        return self._call("multi_set", keys, values)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def append(self, key: str, value: str | bytes) -> None:
        return self._call("append", key, value)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def list_keys(self) -> list[str]:
        return self._call("list_keys")

    def num_keys(self) -> int:
        return self._call("num_keys")

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            return self._call("wait", keys)
        return self._call("wait", keys, timeout)
