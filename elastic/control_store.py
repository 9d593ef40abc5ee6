"""The control store's connection: sealed JSON values under the job's namespace,
reads of many keys in few round trips, and doorbells (who just wrote a key).

Anyone who can reach the store's port can list, read, write and delete keys
(the namespace only keeps jobs apart). So every value anyone acts on is sealed
(elastic/auth.py); protocol.py says what the keys are.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

from elastic.auth import Rejected, Sealer, WarnOnce, stderr_warning
from elastic.exceptions import ElasticError
from elastic.secret_env import forget_env
from elastic.store_link import RECONNECT_WITHIN_S, HealingStore, StoreCalls, keepalive_accepted

ENV_SECRET = "ELASTIC_SECRET"                # protocol.py names them (and documents them)
ENV_SECRET_FILE = "ELASTIC_SECRET_FILE"
ENV_SECRET_FD = "ELASTIC_SECRET_FD"          # a pipe holding the secret (remote.py)

_CHUNK = 512            # keys per check / multi_get in get_present
_SMALL_CHUNK = 32       # ... below which a chunk with a missing key is read key by key
_REPLAY_MEMORY = 1 << 16  # keys whose highest accepted sequence number is remembered
# compare_set(key, _ABSENT, _ABSENT) never creates a missing key and answers with what is
# stored, or with _ABSENT when nothing is: a read that cannot block in one round trip
# (check-then-get takes two). No sealed value is this, so it reads as absent.
_ABSENT = "\0elastic-absent"
_ABSENT_BYTES = _ABSENT.encode()


class ControlError(ElasticError):
    """The job secret is missing, or the control store cannot be reached."""


_SECRET_READ: bytes | None = None     # this process's secret, once read from (and removed from) os.environ


def read_secret_from_env(environ: Mapping[str, str] | None = None) -> bytes:
    """The secret elasticrun handed this process: a 0600 file's (ELASTIC_SECRET_FILE)
    or ELASTIC_SECRET's. Read from this process's own environment, it is then removed
    from it (secret_env.forget): children and /proc/PID/environ do not see it, and
    later calls return what was read."""
    global _SECRET_READ
    own = environ is None or environ is os.environ
    if own and _SECRET_READ is not None:
        return _SECRET_READ
    env = os.environ if environ is None else environ
    path = env.get(ENV_SECRET_FILE)
    if env.get(ENV_SECRET_FD):
        secret = _read_pipe(int(env[ENV_SECRET_FD]))
    elif path:
        with open(path, "rb") as f:
            secret = f.read().strip()
    elif env.get(ENV_SECRET):
        secret = env[ENV_SECRET].encode()
    else:
        raise ControlError("no job secret: set by elasticrun for its workers")
    if own:
        _SECRET_READ = secret
        forget_env((ENV_SECRET, ENV_SECRET_FILE, ENV_SECRET_FD))
    return secret


def _read_pipe(fd: int) -> bytes:
    """Everything on pipe ``fd`` until it ends; then the fd is closed."""
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError as exc:
        raise ControlError(f"cannot read the job secret from fd {fd}: {exc.strerror}") from None
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    return b"".join(chunks).strip()


def connect(addr: str, port: int | str, timeout_s: float, is_master: bool = False) -> dist.TCPStore:
    """One TCPStore client connection (the driver's store: see listen()). It never
    reconnects: long-lived connections use open_link()."""
    return dist.TCPStore(
        addr, int(port), is_master=is_master, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False, use_libuv=True,
    )


def open_link(addr: str, port: int | str, timeout_s: float,
              reconnect_within_s: float = RECONNECT_WITHIN_S,
              warn: Callable[[str], None] = stderr_warning) -> HealingStore:
    """A client connection that reconnects after a reset and has TCP keepalive
    (store_link.py); ControlStore puts the job's namespace on it."""
    return HealingStore(addr, port, timeout_s, reconnect_within_s, warn)


def keepalive_on_accepted(port: int) -> int:
    """Keepalive on the store connections this (driver) process accepted on ``port``."""
    return keepalive_accepted(port)


def listen(addr: str, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """Host the store on ``addr`` only ("0.0.0.0"/"::" for every interface).

    TCPStore(host, is_master=True) listens on every interface whatever ``host``
    says, so the listening socket is made here and handed over by its fd."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6 and addr == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(1024)
        port = sock.getsockname()[1]
        store = dist.TCPStore(
            addr, port, is_master=True, timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)
    except BaseException:
        sock.close()
        raise
    sock.detach()        # the store owns the fd now
    return store


class ControlStore:
    """Sealed JSON values under the job's namespace.

    ``get`` returns a verified value or None; it never raises for what another
    client wrote. ``put(..., keep=True)`` remembers the value so that ``heal()``
    can put it back if something overwrote or deleted it: waiters on a key an
    outsider destroyed get it back within one heal period.
    """

    def __init__(self, store: dist.Store | HealingStore, secret: bytes | str,
                 warn: Callable[[str], None] = stderr_warning) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        namespace = hmac.new(secret, b"elastic-namespace", hashlib.sha256).hexdigest()[:32]
        self._namespace = namespace
        self.rebind(store)
        self.sealer = Sealer(secret, job=namespace)
        self.rejected = WarnOnce(warn)
        self._highest: dict[str, int] = {}
        self._kept: dict[str, bytes] = {}
        self.requests = 0       # store round trips and bytes read, for make scale
        self.bytes_read = 0

    def rebind(self, store: dist.Store | HealingStore) -> None:
        """Talk over ``store`` (a new connection to the same store) from now on, keeping
        the values heal() looks after and the replay memory."""
        self.raw: StoreCalls
        if isinstance(store, HealingStore):
            self.raw = store.with_prefix(self._namespace + "/")
        else:    # torch's stubs lack the append and multi_set its stores have (StoreCalls)
            self.raw = cast(StoreCalls, dist.PrefixStore(self._namespace + "/", store))

    def put(self, key: str, value: Any, keep: bool = False) -> None:
        blob = self.sealer.seal(key, json.dumps(value, sort_keys=True).encode())
        if keep:
            self._kept[key] = blob
        self.requests += 1
        self.raw.set(key, blob)

    def put_many(self, values: Mapping[str, Any], keep: bool = False) -> None:
        """Put {key: value} in one round trip."""
        keys = list(values)
        if not keys:
            return
        blobs = [self.sealer.seal(k, json.dumps(values[k], sort_keys=True).encode())
                 for k in keys]
        if keep:
            self._kept.update(zip(keys, blobs))
        self.requests += 1
        self.raw.multi_set(keys, blobs)

    def rekeep(self, key: str, value: Any) -> None:
        """Where ``key`` is healed, heal it with ``value`` from now on (sealed now, so newer
        than a copy put on another connection): the older kept value would read as a replay."""
        if key in self._kept:
            self._kept[key] = self.sealer.seal(key, json.dumps(value, sort_keys=True).encode())

    def forget(self, key: str) -> None:
        """Stop healing ``key`` (its value stays)."""
        self._kept.pop(key, None)

    def delete(self, key: str) -> None:
        """Remove ``key`` from the store (and stop healing it)."""
        self._kept.pop(key, None)
        self.requests += 1
        self.raw.delete_key(key)

    def get(self, key: str) -> Any:
        """The verified value of ``key``; None when absent, forged or replayed."""
        blob = self.fetch(key)
        return None if blob is None else self._verify(key, blob)

    def get_object(self, key: str) -> dict | None:
        """The verified JSON object under ``key``: None when absent, forged, replayed, not
        an object, or when the store refuses the read. For values that steer the reader,
        which an outsider may have written: ignored, never obeyed, never fatal."""
        try:
            value = self.get(key)
        except (ControlError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def fetch(self, key: str) -> bytes | None:
        """The bytes stored under ``key`` (unverified), or None, in one round trip."""
        self.requests += 1
        blob = bytes(self.raw.compare_set(key, _ABSENT, _ABSENT))
        if blob == _ABSENT_BYTES:
            return None
        self.bytes_read += len(blob)
        return blob

    def get_many(self, keys: Iterable[str]) -> dict[str, Any]:
        """{key: verified value or None}, in one round trip when all exist."""
        keys = list(keys)
        found = self.get_present(keys)
        return {k: found.get(k) for k in keys}

    def get_present(self, keys: Iterable[str]) -> dict[str, Any]:
        """{key: verified value} for those of ``keys`` that hold one."""
        found: dict[str, Any] = {}
        for key, blob in self.raw_present(keys).items():
            value = self._verify(key, blob)
            if value is not None:
                found[key] = value
        return found

    def raw_present(self, keys: Iterable[str]) -> dict[str, bytes]:
        """{key: stored bytes} for those of ``keys`` that exist, unverified.

        Asks about whole chunks at once and splits only a chunk where some key
        is missing, so reading n keys of which m are missing takes about
        n / CHUNK + m·log(CHUNK) round trips, not n."""
        keys = list(keys)
        blobs: dict[str, bytes] = {}
        for i in range(0, len(keys), _CHUNK):
            self._read_chunk(keys[i:i + _CHUNK], blobs)
        return blobs

    def _read_chunk(self, keys: list[str], blobs: dict[str, bytes]) -> None:
        if not keys:
            return
        if len(keys) == 1:
            blob = self.fetch(keys[0])
            if blob is not None:
                blobs[keys[0]] = blob
            return
        self.requests += 1
        if self.raw.check(keys):
            self.requests += 1
            try:
                got = self.raw.multi_get(keys)
            except dist.DistStoreError:
                return       # deleted between the check and the read (after one timeout)
            for k, b in zip(keys, got):
                blobs[k] = bytes(b)
                self.bytes_read += len(blobs[k])
        elif len(keys) > _SMALL_CHUNK:
            half = len(keys) // 2
            self._read_chunk(keys[:half], blobs)
            self._read_chunk(keys[half:], blobs)
        elif len(keys) > 1:
            for key in keys:           # few left: one look each beats halving further
                self._read_chunk([key], blobs)

    def has(self, key: str) -> bool:
        return self.get(key) is not None

    def keys(self) -> list[str]:
        """Every key under the job's namespace (what any client can list too)."""
        return list(self.raw.list_keys())

    def present(self, key: str) -> bool:
        """Whether anything at all is stored under ``key`` (verified or not)."""
        self.requests += 1
        return self.raw.check([key])

    @property
    def kept(self) -> int:
        """How many values heal() looks after."""
        return len(self._kept)

    def heal(self) -> int:
        """Put back every kept value that is missing or was overwritten."""
        kept = list(self._kept.items())
        if not kept:
            return 0
        now = self.raw_present(k for k, _ in kept)
        healed = 0
        for key, blob in kept:
            if now.get(key) != blob:
                self.requests += 1
                self.raw.set(key, blob)
                healed += 1
        return healed

    def _verify(self, key: str, blob: bytes) -> Any:
        if not blob:
            return None
        try:
            seq, payload = self.sealer.open(key, blob)
            value = json.loads(payload)
        except (Rejected, ValueError) as exc:
            self.rejected(key, str(exc) if isinstance(exc, Rejected) else "payload is not JSON")
            return None
        highest = self._highest.get(key, 0)
        if seq < highest:
            self.rejected(key, "an older value replayed")
            return None
        if seq > highest:
            if len(self._highest) >= _REPLAY_MEMORY:
                for old in list(self._highest)[:_REPLAY_MEMORY // 2]:
                    del self._highest[old]
            self._highest[key] = seq
        return value


class Doorbell:
    """Who says they just wrote a sealed key: an unsealed, append-only list of names.

    Writers append their name after putting their sealed value, so the reader
    verifies only the keys of the names that are new since its last look instead
    of asking about every key it still waits for. Names are never trusted: each is
    checked against its sealed key. An outsider can ring false names (they fail
    verification) or wipe the list (the reader's slow full look, every few
    seconds, still finds every sealed key)."""

    def __init__(self, store: ControlStore, key: str) -> None:
        self.store, self.key = store, key
        self._offset = 0

    def ring(self, name: str) -> None:
        self.store.requests += 1
        self.store.raw.append(self.key, f"{name}\n".encode())

    def new_names(self) -> list[str]:
        """Names rung since the last call (all of them again if the list was rewritten)."""
        blob = self.store.fetch(self.key)
        if blob is None:
            self._offset = 0
            return []
        if len(blob) < self._offset:
            self._offset = 0
        end = blob.rfind(b"\n") + 1
        if end <= self._offset:
            return []
        fresh, self._offset = blob[self._offset:end], end
        return [n for n in fresh.decode("ascii", "replace").split("\n") if 0 < len(n) <= 64]


