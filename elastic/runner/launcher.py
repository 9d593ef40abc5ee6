"""Worker processes: start them, stream their output, stop them.

Local hosts are plain subprocesses in their own session, so a whole worker
process tree can be killed at once. On Linux they also get PDEATHSIG, so a
SIGKILLed driver never leaves a local orphan.

Other hosts are reached with ``ssh HOST exec PYTHON -I .../remote.py``; the
worker's environment, secret included, travels as one JSON line on the ssh
process's stdin, never on a command line (see remote.py). The ssh client gets
PDEATHSIG too, and the remote side kills its worker when its stdin ends, so a
dead driver, a killed ssh client or a dropped connection leaves no remote
orphan. A host that cannot be reached makes ssh exit with 255, which the
driver reports as an ssh failure of that host.

"Local" means this machine: localhost, the host name, the addresses of its
interfaces and every loopback address (``is_local``). With ELASTIC_SSH_LOOPBACK=1,
loopback addresses other than 127.0.0.1 and ::1 count as remote, so tests can run
a real sshd on them.
"""

from __future__ import annotations

import collections
import fcntl
import ipaddress
import json
import os
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Protocol

from elastic import protocol
from elastic.runner import remote
from elastic.streams import MAX_LINE_BYTES, pump_output

if TYPE_CHECKING:
    from elastic.messages import Member

_SETPRIV = shutil.which("setpriv")


def _die_with_parent(command: Sequence[str]) -> list[str]:
    """Run through setpriv so the kernel kills the worker if the driver dies
    (a preexec_fn is unsafe while output threads run)."""
    if _SETPRIV and sys.platform.startswith("linux"):
        return [_SETPRIV, "--pdeathsig", "SIGKILL", "--"] + list(command)
    return list(command)


_SIOCGIFADDR = 0x8915


def interface_ipv4(name: str) -> str:
    """The IPv4 address of network interface ``name``; OSError when it has none."""
    if not name or len(name.encode()) > 15 or "/" in name:
        raise OSError(f"{name!r} is not a network interface name")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError as exc:
            reason = ("no such interface" if exc.errno == 19 else "it has no IPv4 address"
                      if exc.errno == 99 else exc.strerror)
            raise OSError(f"{name}: {reason}") from None
    return socket.inet_ntoa(packed[20:24])


def interface_addresses() -> set[str]:
    """Every address of this machine's interfaces (IPv4 by ioctl, IPv6 from /proc)."""
    found: set[str] = set()
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        names = []
    for name in names:
        try:
            found.add(interface_ipv4(name))
        except OSError:
            pass
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                hexaddr = line.split()[0] if line.split() else ""
                if len(hexaddr) == 32:
                    found.add(str(ipaddress.IPv6Address(bytes.fromhex(hexaddr))))
    except (OSError, ValueError):
        pass
    return found


def local_names() -> set[str]:
    """Names and addresses that mean this machine."""
    names = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback",
             "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    names.update(interface_addresses())
    return names


def _normal_ip(host: str) -> str | None:
    try:
        return ipaddress.ip_address(host.strip("[]")).compressed
    except ValueError:
        return None


def is_local(host: str, names: Collection[str] | None = None,
             ssh_loopback: bool | None = None) -> bool:
    """True for this machine's own names and addresses, and for any loopback
    address (127.x.x.x, ::1). With ``ssh_loopback`` (or ELASTIC_SSH_LOOPBACK=1)
    loopback addresses other than 127.0.0.1 and ::1 go through ssh instead,
    which lets one machine test the remote path against a local sshd."""
    names = names if names is not None else local_names()
    if host in names:
        return True
    ip = _normal_ip(host)
    if ip is None:
        return False
    if ssh_loopback is None:
        ssh_loopback = os.environ.get(protocol.ENV_SSH_LOOPBACK) == "1"
    if not ssh_loopback and ipaddress.ip_address(ip).is_loopback:
        return True
    return ip in {_normal_ip(n) for n in names}


def source_address(host: str) -> str | None:
    """The local address this machine uses to reach ``host`` (a UDP connect sends
    nothing); None when the host does not resolve or has no route."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    # IPv4 first: the driver's store listens on 0.0.0.0.
    for family, kind, proto, _, addr in sorted(infos, key=lambda i: i[0] != socket.AF_INET):
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(addr)
                return s.getsockname()[0]
        except OSError:
            continue
    return None


class OutputSink:
    """Prefixes each worker line on the console and optionally keeps per-worker files.

    Output is read in bounded chunks (``streams.pump_output``): the files get the
    bytes as written, the console gets lines cut at ``streams.MAX_LINE_BYTES``
    and at most one progress (``\\r``) update per second per stream.
    ``timestamps`` prefixes console lines with the time they arrived; ``ranks``
    (a set) shows only the lines of workers whose rank in the latest round is in
    it. The last ``TAIL_LINES`` stderr lines of each worker are kept for the
    root-cause report whatever is shown.
    """

    TAIL_LINES = 20
    TAILS_KEPT = 256                  # workers whose tails are kept (the newest)

    def __init__(self, output_dir: str | None = None, quiet: bool = False,
                 timestamps: bool = False, ranks: Iterable[int] | None = None,
                 max_line: int = MAX_LINE_BYTES) -> None:
        self._dir = output_dir
        self._max_line = max_line
        self._quiet = quiet
        self._timestamps = timestamps
        self._shown_ranks = None if ranks is None else set(ranks)
        self._rank_of: dict[str, int] = {}
        self._tails: collections.OrderedDict[str, collections.deque[str]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        # Set when a worker's output reaches its end, which is when the process (or its ssh)
        # exits: the driver's tick waits on it and polls exits at once (a crash is then seen
        # without waiting out the rest of a tick).
        self.stream_ended = threading.Event()

    def set_ranks(self, members: Sequence[Member]) -> None:
        """The ranks of a newly published round (protocol.Member)."""
        with self._lock:
            self._rank_of = {m.worker_id: m.rank for m in members}

    def tail(self, worker_id: str) -> list[str]:
        """The last stderr lines of ``worker_id`` (text), oldest first."""
        with self._lock:
            return list(self._tails.get(worker_id, ()))

    def attach(self, worker_id: str, stream: IO[bytes], name: str,
               on_line: Callable[[bytes], None] | None = None) -> threading.Thread:
        files = None
        if self._dir:
            path = os.path.join(self._dir, f"worker.{worker_id}")
            os.makedirs(path, exist_ok=True)
            files = open(os.path.join(path, name), "ab", buffering=0)
        thread = threading.Thread(target=self._pump,
                                  args=(worker_id, stream, name, files, on_line),
                                  daemon=True, name=f"output-{worker_id}-{name}")
        thread.start()
        return thread

    def write_lines(self, worker_id: str, name: str, lines: Sequence[str]) -> None:
        """Lines that arrived by other means (a joining agent's report): the same
        prefix on the console, and the same per-worker file."""
        if self._dir:
            path = os.path.join(self._dir, f"worker.{worker_id}")
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, name), "ab") as f:
                f.write("".join(line + "\n" for line in lines).encode())
        for line in lines:
            self._show(worker_id, name, line)

    def _show(self, worker_id: str, name: str, line: str) -> None:
        with self._lock:
            if name == "stderr":
                tail = self._tails.get(worker_id)
                if tail is None:
                    tail = self._tails[worker_id] = collections.deque(maxlen=self.TAIL_LINES)
                    while len(self._tails) > self.TAILS_KEPT:
                        self._tails.popitem(last=False)
                tail.append(line)
            if self._quiet or (self._shown_ranks is not None
                               and self._rank_of.get(worker_id) not in self._shown_ranks):
                return
            target = sys.stdout if name == "stdout" else sys.stderr
            stamp = time.strftime("%Y-%m-%d %H:%M:%S ") if self._timestamps else ""
            target.write(f"{stamp}[{worker_id}]<{name}>:{line}\n")
            target.flush()

    def _pump(self, worker_id, stream, name, file, on_line=None):
        def handle(raw):
            if on_line is not None:
                on_line(raw)
            self._show(worker_id, name, raw.decode("utf-8", "replace"))

        try:
            pump_output(stream, handle, on_chunk=file.write if file is not None else None,
                        max_line=self._max_line)
        finally:
            if file is not None:
                file.close()
            self.stream_ended.set()


class LocalProcess(Protocol):
    """What a worker's handle needs of its process: a ``subprocess.Popen``, or a worker a
    warm spare forked (runner/spares.py ``ForkedWorker``)."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...


class WorkerProcess:
    """A started worker and the means to stop it."""

    def __init__(self, worker_id: str, host: str, popen: LocalProcess,
                 pumps: list[threading.Thread]) -> None:
        self.worker_id = worker_id
        self.host = host
        self.popen = popen
        self._pumps = pumps

    def poll(self) -> int | None:
        return self.popen.poll()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        forked = getattr(self.popen, "signal_group", None)   # a spare's, maybe not forked yet
        if forked is not None:
            forked(sig)
            return
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def join_output(self, timeout: float = 2.0) -> None:
        for pump in self._pumps:
            pump.join(timeout)

    def describe_exit(self, code: int) -> str:
        """Words to add after "exited with code N"; a local exit speaks for itself."""
        return ""


def start_local(worker_id: str, host: str, command: Sequence[str], env: Mapping[str, str],
                sink: OutputSink) -> WorkerProcess:
    popen = subprocess.Popen(
        _die_with_parent(command), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
    )
    return adopt_local(worker_id, host, popen, sink)


def adopt_local(worker_id: str, host: str, popen: LocalProcess,
                sink: OutputSink) -> WorkerProcess:
    """A local process already started (one a warm spare forked) as a worker."""
    assert popen.stdout is not None and popen.stderr is not None    # PIPEs, as asked
    pumps = [sink.attach(worker_id, popen.stdout, "stdout"),
             sink.attach(worker_id, popen.stderr, "stderr")]
    return WorkerProcess(worker_id, host, popen, pumps)


def start_spare(command: Sequence[str], env: Mapping[str, str], stdin: int) -> subprocess.Popen:
    """A warm spare (runner/spares.py): its stdin is ``stdin`` (its end of the socket that
    carries the specs of the workers it forks); what it says itself goes to our stderr."""
    return subprocess.Popen(
        _die_with_parent(command), env=env, stdin=stdin, stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


def end_spare(popen: subprocess.Popen) -> None:
    """Kill a spare that is no longer wanted and reap it; its pipes are closed."""
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for stream in (popen.stdin, popen.stdout, popen.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


# -- remote hosts over ssh --------------------------------------------------------------

SSH_DEFAULT_OPTIONS = ("BatchMode=yes", "ConnectTimeout=10", "ServerAliveInterval=5",
                       "ServerAliveCountMax=3")
SSH_FAILED = 255                # what ssh exits with when it, not the command, failed
REMOTE_SCRIPT = os.path.abspath(remote.__file__)

# Per-login or per-host variables that must not follow the worker to another host.
_NOT_FORWARDED = {"HOME", "HOSTNAME", "LOGNAME", "USER", "SHELL", "PWD", "OLDPWD", "SHLVL",
                  "_", "TERM", "TERMCAP", "DISPLAY", "MAIL", "LS_COLORS", "STY", "WINDOW",
                  "TMUX", "TMUX_PANE", "DBUS_SESSION_BUS_ADDRESS"}
_NOT_FORWARDED_PREFIXES = ("SSH_", "XDG_", "BASH_FUNC_")


@dataclass
class SshSettings:
    """How to reach hosts that are not local. Host keys are checked as the
    user's ssh configuration says (known_hosts); nothing here turns that off."""

    port: int | None = None
    identity_file: str | None = None
    options: list[str] = field(default_factory=list)     # "Key=Value" strings for ssh -o
    python: str = "python3"                          # runs remote.py on the host

    def argv(self, host: str) -> list[str]:
        ssh = shutil.which("ssh") or "ssh"
        args = [ssh, "-T"]
        # ssh keeps the first value it gets for an option: the user's come first.
        for option in list(self.options) + list(SSH_DEFAULT_OPTIONS):
            args += ["-o", option]
        if self.port is not None:
            args += ["-p", str(self.port)]
        if self.identity_file:
            args += ["-i", self.identity_file]
        remote_command = "exec " + shlex.join([self.python, "-I", REMOTE_SCRIPT])
        return args + ["--", host.strip("[]"), remote_command]


def check_ssh_option(option: str) -> str:
    """``Key=Value`` for ``ssh -o``; ValueError(reason) otherwise."""
    key, sep, value = option.partition("=")
    if not sep or not key.isalnum() or not value.strip():
        raise ValueError(f"--ssh-option {option!r} is not KEY=VALUE (e.g. "
                         "UserKnownHostsFile=/path/known_hosts)")
    return f"{key}={value}"


def forwarded_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of the driver-side worker environment that goes to a remote host."""
    return {k: v for k, v in env.items()
            if k not in _NOT_FORWARDED and not k.startswith(_NOT_FORWARDED_PREFIXES)}


def remote_spec(command: Iterable[str], env: Mapping[str, str], cwd: str) -> bytes:
    """The JSON line remote.py reads: the secret moves out of env into its own field."""
    env = forwarded_env(env)
    secret = env.pop(protocol.ENV_SECRET, "")
    return (json.dumps({"command": list(command), "cwd": cwd, "env": env, "secret": secret},
                       separators=(",", ":")) + "\n").encode()


class SshWorkerProcess(WorkerProcess):
    """A worker on another host: ``popen`` is its ssh client."""

    def __init__(self, worker_id: str, host: str, popen: subprocess.Popen[bytes],
                 pumps: list[threading.Thread], tail: list[str]) -> None:
        super().__init__(worker_id, host, popen, pumps)
        self.ssh = popen
        self._tail = tail
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None:
            self._code = self.popen.poll()
            if self._code is None:
                return None
            try:
                if self.ssh.stdin is not None:      # (stdin=PIPE: always)
                    self.ssh.stdin.close()
            except (OSError, ValueError):
                pass
        return self._code

    def describe_exit(self, code: int) -> str:
        """255 is ssh's own failure (unreachable host, refused key, lost link) and a
        signal death is the ssh client's, since remote.py turns the worker's into
        128 + N. A worker that itself exits 255 reads the same: ssh cannot tell."""
        if code == SSH_FAILED:
            for pump in self._pumps[-1:]:       # let stderr drain: ssh's own last words
                pump.join(1.0)
            last = self._tail[-1] if self._tail else ""
            return " (ssh failure" + (f": {last}" if last else "") + ")"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f" (ssh connection lost: the ssh client was killed by {name})"
        return ""


def start_ssh(worker_id: str, host: str, command: Sequence[str], env: Mapping[str, str],
              sink: OutputSink, settings: SshSettings,
              store_addr: str | None = None) -> SshWorkerProcess:
    """Start ``command`` on ``host`` through ssh. ``env`` is the full worker
    environment (secret included); it is written to ssh's stdin, never argv.
    ``store_addr`` None: workers reach the store at the address this machine
    uses towards ``host``, worked out in the writer thread (DNS may be slow)."""
    popen = subprocess.Popen(
        _die_with_parent(settings.argv(host)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
    )
    stdin, stdout, stderr = popen.stdin, popen.stdout, popen.stderr
    assert stdin is not None and stdout is not None and stderr is not None   # PIPEs, as asked
    tail: list[str] = []

    def keep_tail(raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").strip()
        if line:
            tail[:] = [line[:300]]

    pumps = [sink.attach(worker_id, stdout, "stdout"),
             sink.attach(worker_id, stderr, "stderr", on_line=keep_tail)]
    env = dict(env)
    cwd = os.getcwd()

    def send() -> None:
        # Only now, off the driver's thread: the address may need a DNS lookup.
        # If even that fails, remote.py falls back to sshd's SSH_CONNECTION.
        env[protocol.ENV_ADDR] = store_addr or source_address(host) or ""
        try:
            stdin.write(remote_spec(command, env, cwd))
            stdin.flush()
        except (OSError, ValueError):
            pass        # ssh is gone already; its exit code tells why
        # stdin stays open: its end is what tells the remote side we are gone.

    threading.Thread(target=send, daemon=True, name=f"ssh-spec-{worker_id}").start()
    return SshWorkerProcess(worker_id, host, popen, pumps, tail)
