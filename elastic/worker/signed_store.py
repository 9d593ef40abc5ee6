"""The store that gloo and NCCL rendezvous through: it seals what they set and
verifies what they get (docs/architecture.md, trust model).

Peers publish their data-plane addresses here. Unsealed, anyone who reaches the
driver's store could put its own address into a round's rendezvous and then
talk to the workers' data plane (which unpickles `broadcast_object` payloads).
Sealed, a value that does not verify for its exact key (and so its round) is
treated as not there yet: the reader keeps waiting for the real one, and the
writer puts its own value back if something overwrote it. Waits poll with
``check`` instead of blocking in the store, so the worker's other threads (the
abort watch) never queue behind a rendezvous on the shared connection.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

import torch.distributed as dist

from elastic.auth import Rejected
from elastic.exceptions import ElasticError
from elastic.protocol import HEAL_EVERY_S

if TYPE_CHECKING:
    from elastic.protocol import ControlStore

POLL_MIN_S = 0.001
POLL_MAX_S = 0.02


class RendezvousTimeout(ElasticError):
    """A rendezvous key never held a value with a valid seal."""


def _seconds(timeout: timedelta | float | None, default: float) -> float:
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


class SignedStore(dist.Store):
    """``scope`` (for example ``pg/7/``) is part of every key sealed, so a value
    from another round never verifies in this one."""

    def __init__(self, control: ControlStore, scope: str, timeout_s: float) -> None:
        super().__init__()
        self._raw = control.raw
        self._sealer = control.sealer
        self._reject = control.rejected
        self._scope = scope
        self._timeout_s = float(timeout_s)
        self._mine: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._healed_at = time.monotonic()

    # -- sealing ---------------------------------------------------------------------
    def _full(self, key: str) -> str:
        return self._scope + key

    def _open(self, full: str, blob: bytes) -> bytes | None:
        try:
            return self._sealer.open(full, blob)[1]
        except Rejected as exc:
            self._reject(full, str(exc))
            return None

    def heal(self) -> None:
        """Put back what this process set, where something else overwrote it."""
        now = time.monotonic()
        if now - self._healed_at < HEAL_EVERY_S:
            return
        self._healed_at = now
        with self._lock:
            mine = list(self._mine.items())
        for full, blob in mine:
            if not self._raw.check([full]) or bytes(self._raw.get(full)) != blob:
                self._raw.set(full, blob)

    def _await(self, keys: list[str], timeout: timedelta | None) -> list[bytes]:
        """Verified payloads of ``keys`` once every one of them verifies."""
        fulls = [self._full(k) for k in keys]
        deadline = time.monotonic() + _seconds(timeout, self._timeout_s)
        pause = POLL_MIN_S
        while True:
            if self._raw.check(fulls):
                blobs = self._raw.multi_get(fulls) if len(fulls) > 1 else [self._raw.get(fulls[0])]
                values = [self._open(f, bytes(b)) for f, b in zip(fulls, blobs)]
                verified = [v for v in values if v is not None]
                if len(verified) == len(values):
                    return verified
            self.heal()
            if time.monotonic() > deadline:
                raise RendezvousTimeout(f"rendezvous keys {keys} did not appear (with a valid "
                                        f"seal) within {_seconds(timeout, self._timeout_s):.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)

    # -- the Store interface gloo and NCCL use --------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        full = self._full(key)
        blob = self._sealer.seal(full, value)
        with self._lock:
            self._mine[full] = blob
        self._raw.set(full, blob)

    def get(self, key: str) -> bytes:
        return self._await([key], None)[0]

    def multi_get(self, keys: Iterable[str]) -> list[bytes]:
        return self._await(list(keys), None)

    def multi_set(self, keys: Iterable[str], values: Iterable[str | bytes]) -> None:
        for key, value in zip(keys, values):
            self.set(key, value)

    def wait(self, keys: Iterable[str], timeout: timedelta | None = None) -> None:
        self._await(list(keys), timeout)

    def check(self, keys: Iterable[str]) -> bool:
        fulls = [self._full(k) for k in keys]
        if not self._raw.check(fulls):
            return False
        return all(self._open(f, bytes(self._raw.get(f))) is not None for f in fulls)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``desired`` if the verified current value is ``expected`` (or the
        key is unset and ``expected`` is empty); returns the value now held."""
        full = self._full(key)
        current = None
        if self._raw.check([full]):
            current = self._open(full, bytes(self._raw.get(full)))
        expected = bytes(expected) if not isinstance(expected, str) else expected.encode()
        if (current is None and not expected) or current == expected:
            self.set(key, desired)
            return desired if not isinstance(desired, str) else desired.encode()
        return current if current is not None else expected

    def add(self, key: str, amount: int) -> NoReturn:
        """Counters cannot be sealed, and a non-number planted under the key would
        close the connection: neither gloo nor NCCL rendezvous uses one."""
        raise RuntimeError(f"elastic's rendezvous store has no counters (add {key!r})")

    def delete_key(self, key: str) -> bool:
        full = self._full(key)
        with self._lock:
            self._mine.pop(full, None)
        return self._raw.delete_key(full)

    def delete_mine(self) -> None:
        """Remove what this process set (its round is over: every peer has read it)."""
        with self._lock:
            mine, self._mine = list(self._mine), {}
        for full in mine:
            self._raw.delete_key(full)

    def num_keys(self) -> int:
        return self._raw.num_keys()

    def set_timeout(self, timeout: timedelta | float | None) -> None:
        self._timeout_s = _seconds(timeout, self._timeout_s)
