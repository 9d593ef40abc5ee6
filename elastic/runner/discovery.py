"""Host discovery: which hosts may run workers right now, as ``{host: slots}``.

Discovery scripts are untrusted, so every way one can fail (missing, hanging,
crashing, printing garbage) becomes a one-line ``DiscoveryError`` the driver
can log without a traceback.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from elastic.exceptions import ElasticError

if TYPE_CHECKING:
    from elastic.runner.interfaces import DiscoverySource

_MAX_MESSAGE = 300
_HOSTNAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
_SLOTS_RE = re.compile(r"[0-9]+")
_BRACKET_RE = re.compile(r"\[([^\[\]]*)\](.*)")


def _one_line(text: str, limit: int = _MAX_MESSAGE, keep_tail: bool = False) -> str:
    """Collapse whitespace (newlines included) and cap the length; ``keep_tail``
    keeps the end, since a traceback's useful part is its last line."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    return "..." + text[3 - limit:] if keep_tail else text[: limit - 3] + "..."


class DiscoveryError(ElasticError):
    """A discovery failure whose str() is a single line fit for a user log."""

    def __init__(self, message: str):
        super().__init__(_one_line(message))


def _check_default_slots(default_slots: int | None) -> int:
    if default_slots is not None and (type(default_slots) is not int or default_slots < 1):
        raise ValueError(f"default_slots must be an integer >= 1, got {default_slots!r}")
    return 1 if default_slots is None else default_slots


def _parse_slots(text: str) -> int:
    # Plain decimal digits only: int() would also accept "+3", " 3" or "3_0".
    if not _SLOTS_RE.fullmatch(text) or int(text) < 1:
        raise ValueError(f"invalid slot count {text!r}")
    return int(text)


def _parse_entry(entry: str, default_slots: int) -> tuple[str, str, int]:
    """``host[:slots]`` -> (host, duplicate key, slots); ValueError(reason)."""
    if any(c.isspace() for c in entry):
        raise ValueError("whitespace inside host entry")
    if entry.startswith("["):
        m = _BRACKET_RE.fullmatch(entry)
        if not m:
            raise ValueError("unterminated '[' in IPv6 address")
        host, rest = m.groups()
        if not host:
            raise ValueError("empty host")
        try:
            key = ipaddress.IPv6Address(host).compressed  # [::1] == [0::1]
        except ValueError:
            raise ValueError(f"invalid IPv6 address {host!r}") from None
        if rest and not rest.startswith(":"):
            raise ValueError(f"unexpected text {rest!r} after ']'")
        return host, key, _parse_slots(rest[1:]) if rest else default_slots
    if entry.count(":") > 1:
        raise ValueError("IPv6 addresses must be in brackets, e.g. [::1]:2")
    host, sep, slots_text = entry.partition(":")
    if not host:
        raise ValueError("empty host")
    if not _HOSTNAME_RE.fullmatch(host):
        raise ValueError(f"invalid host name {host!r}")
    if host[0] in "-.":  # a leading '-' would be read as an option by ssh
        raise ValueError(f"host name {host!r} must start with a letter or digit")
    slots = _parse_slots(slots_text) if sep else default_slots
    return host, host.lower(), slots  # DNS names are case-insensitive


def _parse_entries(items: Iterable[tuple[int, str]], default_slots: int | None, source: str,
                   unit: str) -> dict[str, int]:
    slots_default = _check_default_slots(default_slots)
    hosts: dict[str, int] = {}
    keys = set()
    for number, entry in items:
        try:
            host, key, slots = _parse_entry(entry, slots_default)
            if key in keys:
                raise ValueError(f"duplicate host {host!r}")
        except ValueError as e:
            raise DiscoveryError(
                f"{source}: {unit} {number}: {e} in {_one_line(entry, 80)!r}") from None
        keys.add(key)
        hosts[host] = slots
    return hosts


def parse_hosts(text: str, default_slots: int | None = None,
                source: str = "discovery script") -> dict[str, int]:
    """Parse one ``host`` or ``host:slots`` per line; ``#`` starts a comment.

    No hosts returns ``{}``: a cluster may shrink to nothing; the driver decides.
    """
    lines = ((n, line.split("#", 1)[0].strip()) for n, line in enumerate(text.splitlines(), 1))
    return _parse_entries(((n, e) for n, e in lines if e), default_slots, source, "line")


def parse_host_list(arg: str) -> dict[str, int]:
    """Parse the ``-H host1:2,host2,[::1]:3`` flag (one slot by default)."""
    if not arg.strip():
        raise DiscoveryError("-H: no hosts given")
    items = ((n, e.strip()) for n, e in enumerate(arg.split(","), 1))
    return _parse_entries(items, None, "-H", "entry")


class Discovery:
    """Interface: ``discover()`` returns the current ``{host: slots}``."""

    def discover(self) -> dict[str, int]:
        raise NotImplementedError

    def run_once(self) -> dict[str, int]:
        return self.discover()


class FixedDiscovery(Discovery):
    """A static host set, e.g. from ``-H``."""

    def __init__(self, hosts: dict[str, int]):
        self._hosts = dict(hosts)

    def discover(self) -> dict[str, int]:
        return dict(self._hosts)  # a copy: callers cannot alter later results


class ScriptDiscovery(Discovery):
    """Runs a user's executable (no shell) and parses its stdout as hosts.

    It runs in its own session so a timeout can kill the whole process group:
    a grandchild holding our pipe open must not hang the driver.
    """

    def __init__(self, path: str | os.PathLike[str], default_slots: int | None = None,
                 timeout: float | None = 30.0) -> None:
        self.path = os.fspath(path)
        self.default_slots = default_slots
        _check_default_slots(default_slots)
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.timeout = timeout

    def validate(self) -> None:
        """Check the script exists and is executable, without running it."""
        if not os.path.exists(self.path):
            raise DiscoveryError(f"discovery script not found: {self.path}")
        if os.path.isdir(self.path):
            raise DiscoveryError(f"discovery script is a directory: {self.path}")
        if not os.access(self.path, os.X_OK):
            raise DiscoveryError(f"discovery script is not executable: {self.path} (try chmod +x)")

    def discover(self) -> dict[str, int]:
        self.validate()
        name = f"discovery script {self.path}"
        try:
            proc = subprocess.Popen(
                [self.path], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            raise DiscoveryError(f"cannot run {name}: {e.strerror or e}") from None
        try:
            out, err = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            script_exited = proc.poll() is not None
            self._kill(proc)
            if script_exited:
                raise DiscoveryError(f"{name} exited but a child process kept its output "
                                     f"open for more than {self.timeout:g}s") from None
            raise DiscoveryError(f"{name} timed out after {self.timeout:g}s") from None
        except BaseException:
            self._kill(proc)
            raise

        if proc.returncode != 0:
            rc = proc.returncode
            prefix = f"{name} " + (f"was killed by signal {-rc}" if rc < 0
                                   else f"exited with code {rc}")
            # Spend what is left of the message budget on the stderr tail.
            budget = max(60, _MAX_MESSAGE - len(prefix) - 2)
            stderr = _one_line(err.decode("utf-8", "replace"), budget, keep_tail=True)
            raise DiscoveryError(f"{prefix}: {stderr or '(no stderr)'}")
        return parse_hosts(out.decode("utf-8", "replace"), self.default_slots, source=name)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:  # the script leads its own session, so its pid is the group id
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            proc.communicate(timeout=2.0)
        except subprocess.TimeoutExpired:
            # Something left the group (e.g. called setsid) and still holds
            # a pipe: stop reading rather than wait for it.
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            proc.kill()
            proc.wait()


@dataclasses.dataclass(frozen=True)
class DiscoveryResult:
    """One discovery attempt: exactly one of ``hosts``/``error`` is set."""

    hosts: dict[str, int] | None
    error: str | None
    at: float


class BackgroundDiscovery:
    """Re-runs a discoverer every ``interval`` seconds on a daemon thread.

    A slow script must not stall the driver, so results pass through a deque
    (atomic append/popleft; no lock is held while the script runs).  Only the
    newest ``max_pending`` results are kept if the caller stops polling.
    """

    def __init__(self, discoverer: DiscoverySource, interval: float,
                 clock: Callable[[], float] = time.monotonic, max_pending: int = 256):
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        self.discoverer = discoverer
        self.interval = interval
        self._clock = clock
        self._results: collections.deque = collections.deque(maxlen=max_pending)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("BackgroundDiscovery already started")
        self._thread = threading.Thread(target=self._run, name="elastic-discovery", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop; True if the thread ended within ``timeout``.  A script mid-run
        is bounded by its own timeout, and the daemon thread cannot block exit."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def poll(self) -> list[DiscoveryResult]:
        """Return, without blocking, all results since the previous poll."""
        results = []
        while True:
            try:
                results.append(self._results.popleft())
            except IndexError:
                return results

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                result = DiscoveryResult(self.discoverer.discover(), None, self._clock())
            except Exception as e:  # even a bug in a custom discoverer must not end polling
                error = str(e) if isinstance(e, DiscoveryError) else f"{type(e).__name__}: {e}"
                result = DiscoveryResult(None, _one_line(error), self._clock())
            if self._stop.is_set():
                return
            self._results.append(result)
            self._stop.wait(self.interval)
