"""Sealed values: what makes a store value trustworthy (docs/architecture.md, trust model).

The driver's TCPStore accepts any client that reaches its port, and such a
client can list, set and delete every key. So trust lives in the values: each
one is sealed with an HMAC (the job secret is its key) over the job, the key,
a sequence number and the payload. A value read back is accepted only if its
seal verifies for exactly that key; a value that does not (garbage, a forgery,
a value copied from another key or job, an older value replayed) counts as
absent, with one rate-limited warning naming the key. Forgery is never fatal.

Layout: ``MAC (64 hex) "." SEQ (decimal) "." PAYLOAD``. SEQ grows with every
seal a process makes, so a reader that remembers the highest SEQ it accepted
for a key rejects a replay of an older value of that key.
"""

from __future__ import annotations

import hashlib
import hmac
import sys
import threading
import time
from collections.abc import Callable

from elastic.exceptions import ElasticError

MAC_LEN = 64
_VERSION = b"elastic-seal-v1"
WARN_EVERY_S = 60.0      # per key
WARN_BURST = 10          # warnings per WARN_BURST_S over all keys (a flood stays quiet)
WARN_BURST_S = 5.0


def _to_bytes(value: str | bytes) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class _Sequence:
    """Process-wide, strictly increasing, and ahead of any earlier process's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def next(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, time.time_ns())
            return self._last


_SEQUENCE = _Sequence()


class Rejected(ElasticError):
    """A value failed verification; str() says why."""


class Sealer:
    """Seals and opens values for one job (one secret)."""

    def __init__(self, secret: str | bytes, job: str | bytes = b"") -> None:
        self._secret = _to_bytes(secret)
        self._job = _to_bytes(job)

    def _mac(self, key: str, seq: bytes, payload: bytes) -> bytes:
        message = b"\0".join((_VERSION, self._job, key.encode(), seq, payload))
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, payload: str | bytes, seq: int | None = None) -> bytes:
        payload = _to_bytes(payload)
        seq_bytes = str(seq if seq is not None else _SEQUENCE.next()).encode()
        return self._mac(key, seq_bytes, payload) + b"." + seq_bytes + b"." + payload

    def open(self, key: str, blob: str | bytes) -> tuple[int, bytes]:
        """(seq, payload) of a value sealed for ``key``; Rejected otherwise."""
        blob = _to_bytes(blob)
        mac, dot, rest = blob[:MAC_LEN], blob[MAC_LEN:MAC_LEN + 1], blob[MAC_LEN + 1:]
        seq_bytes, sep, payload = rest.partition(b".")
        if dot != b"." or not sep or not seq_bytes.isdigit() or len(seq_bytes) > 20:
            raise Rejected("not a sealed value")
        if not hmac.compare_digest(mac, self._mac(key, seq_bytes, payload)):
            raise Rejected("seal does not verify (forged, or written for another key or job)")
        return int(seq_bytes), payload


MIN_SECRET_BYTES = 16
# The placeholder examples/kubernetes/secret.yaml ships: it works as a secret, so it is refused.
EXAMPLE_SECRETS = (b"replace-me-with-openssl-rand-hex-32",)


def weak_secret(secret: str | bytes) -> str | None:
    """Why ``secret`` must not seal a job (too short, or an example's placeholder), or None."""
    value = _to_bytes(secret).strip()
    if value in EXAMPLE_SECRETS:
        return "is the example's placeholder; make one with: openssl rand -hex 32"
    if len(value) < MIN_SECRET_BYTES:
        return (f"is {len(value)} bytes; a job secret needs at least {MIN_SECRET_BYTES} "
                "(openssl rand -hex 32)")
    return None


def stderr_warning(message: str) -> None:
    sys.stderr.write(f"elastic: warning: {message}\n")
    sys.stderr.flush()


class WarnOnce:
    """At most one warning per key per WARN_EVERY_S, and a cap over all keys."""

    def __init__(self, emit: Callable[[str], None] = stderr_warning) -> None:
        self._emit = emit
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._recent: list[float] = []
        self.count = 0           # every rejection, warned or not (tests read it)

    def __call__(self, key: str, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.count += 1
            if now - self._last.get(key, -WARN_EVERY_S) < WARN_EVERY_S:
                return
            self._recent = [t for t in self._recent if now - t < WARN_BURST_S]
            if len(self._recent) >= WARN_BURST:
                return
            self._last[key] = now
            self._recent.append(now)
        self._emit(f"ignored control-store key {key!r}: {why}")
