"""Host bookkeeping for the elastic driver: discovered hosts and blacklisting.

Pure state with an injected clock (every call takes ``now``), no threads and
no I/O, so the driver's policy can be tested deterministically.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from collections.abc import Iterable

__all__ = ["HostChanges", "HostManager"]


@dataclasses.dataclass(frozen=True)
class HostChanges:
    """Difference between two successive available host sets."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()  # still present, different slot count

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


class HostManager:
    """Tracks which discovered hosts may be used and which are blacklisted.

    ``cooldown_range=None`` makes blacklisting permanent.  With
    ``(min_s, max_s)`` a failed host returns after
    ``min(max_s, min_s * 2**(failures - 1))`` seconds, so a flaky host is
    retried but progressively less often.  An ``rng`` (random.Random) adds
    jitter so several hosts that failed together do not return together.

    Hosts are always reported in the order this manager first saw them:
    rank assignment follows host order, and reshuffling it whenever a
    discovery script prints hosts in a different order would move ranks
    between hosts for no reason.

    ``version`` grows whenever what the reads report may have changed (a new
    discovery result, a blacklisting, a cooldown that ``returning`` saw run out),
    so a caller can tell in O(1) that nothing did. ``copy()`` is cheap: the
    driver's policy takes one only when it blacklists within a tick.
    """

    def __init__(self, cooldown_range: tuple[float, float] | None = None,
                 rng: random.Random | None = None):
        if cooldown_range is not None:
            lo, hi = cooldown_range
            if not (0 <= lo <= hi) or math.isinf(hi):
                raise ValueError(
                    f"cooldown_range must satisfy 0 <= min <= max < inf, got {cooldown_range!r}")
            cooldown_range = (float(lo), float(hi))
        self._cooldown = cooldown_range
        self._rng = rng
        self._seen: dict[str, None] = {}  # insertion order = first seen
        self._discovered: dict[str, int] = {}   # kept in first-seen order
        self._failures: dict[str, int] = {}
        # host -> time it may return (inf = never).  Expired entries stay
        # until returning() reports them, so no restoration goes unlogged.
        self._until: dict[str, float] = {}
        self._last_available: dict[str, int] = {}
        self.version = 0
        self._last_result: dict[str, int] = {}   # update's last input (replaced, never changed)
        self._version_after, self._updated_at = -1, -math.inf

    def copy(self) -> HostManager:
        """An independent manager in the same state (its rng too), without a deep copy."""
        other = HostManager.__new__(HostManager)
        other.__dict__.update(self.__dict__)
        for name in ("_seen", "_discovered", "_failures", "_until", "_last_available"):
            setattr(other, name, dict(getattr(self, name)))
        other._rng = copy.copy(self._rng)
        return other

    # -- discovery ---------------------------------------------------------

    def update(self, discovered: dict[str, int], now: float) -> HostChanges:
        """Record a discovery result; report changes to the available set.

        The comparison is against the available set at the previous update,
        so a host blacklisted in between shows up as removed, and one whose
        cooldown expired shows up as added.
        """
        if discovered == self._last_result and self.version == self._version_after \
                and now >= self._updated_at \
                and not any(self._updated_at < t <= now for t in self._until.values()):
            return HostChanges()   # the same result again (a C-speed compare at 4,096 hosts)
        for host, slots in discovered.items():
            if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
                raise ValueError(f"invalid slot count {slots!r} for host {host!r}")
        self._remember(discovered)
        ordered = {h: discovered[h] for h in self._ordered(discovered)}
        if ordered != self._discovered:        # both in first-seen order
            self.version += 1
        self._discovered = ordered
        previous = self._last_available
        current = self.available(now)
        self._last_available = current
        self._last_result, self._version_after, self._updated_at = dict(discovered), \
            self.version, now
        return HostChanges(
            added=tuple(h for h in current if h not in previous),
            removed=tuple(h for h in self._ordered(previous) if h not in current),
            changed=tuple(h for h in current if h in previous and previous[h] != current[h]),
        )

    def discovered(self) -> dict[str, int]:
        """The last discovered set (blacklisted hosts included), first-seen order."""
        return dict(self._discovered)

    def available(self, now: float) -> dict[str, int]:
        """Discovered hosts that are not currently blacklisted, first-seen order."""
        until = self._until
        if not until:
            return dict(self._discovered)
        return {h: n for h, n in self._discovered.items() if until.get(h, -math.inf) <= now}

    # -- blacklisting ------------------------------------------------------

    def blacklist(self, host: str, now: float) -> float:
        """Count a failure on ``host`` and bar it; returns when it may return.

        Blacklisting a host that is already barred does not count again:
        several workers on one host usually fail together, and that is one
        host failure, not many.
        """
        if self.is_blacklisted(host, now):
            return self._until[host]
        self._remember((host,))
        failures = self._failures.get(host, 0) + 1
        self._failures[host] = failures
        if self._cooldown is None:
            until = math.inf
        else:
            lo, hi = self._cooldown
            delay = min(hi, lo * 2 ** (failures - 1))
            if self._rng is not None:
                delay = self._rng.uniform(delay, min(hi, delay * 1.5))
            until = now + delay
        self._until[host] = until
        self.version += 1
        return until

    def export(self, now: float) -> dict:
        """{host: {"failures", "left_s"}}: the blacklist as a restarted driver takes it
        back (``left_s`` None: barred for good); runner/state_dir.py keeps it."""
        return {h: {"failures": n, "left_s": None if math.isinf(self._until.get(h, -math.inf))
                    else max(0.0, self._until.get(h, now) - now)}
                for h, n in self._failures.items()}

    def restore(self, saved: dict, now: float) -> None:
        """Take back what ``export`` gave (bad entries are skipped)."""
        for host, entry in saved.items():
            try:
                failures, left = int(entry["failures"]), entry["left_s"]
                until = math.inf if left is None else now + float(left)
            except (KeyError, TypeError, ValueError):
                continue
            self._remember((host,))
            self._failures[host] = failures
            if left is None or float(left) > 0:
                self._until[host] = until
        self.version += 1

    def failures(self, host: str) -> int:
        """How many times ``host`` has been blacklisted."""
        return self._failures.get(host, 0)

    def is_blacklisted(self, host: str, now: float) -> bool:
        return self._until.get(host, -math.inf) > now

    def blacklisted(self, now: float) -> tuple[str, ...]:
        """Hosts barred at ``now`` (discovered or not), first-seen order."""
        return tuple(h for h in self._ordered(self._until) if self.is_blacklisted(h, now))

    def cooldowns(self, now: float) -> dict[str, float]:
        """Barred hosts -> seconds until they may return (inf: never), first-seen order."""
        return {h: self._until[h] - now for h in self.blacklisted(now)}

    def returning(self, now: float) -> tuple[str, ...]:
        """Discovered hosts whose cooldown expired since the previous call.

        Each restoration is reported once, so the driver can log it.  Hosts
        no longer discovered are dropped silently: they will show up as
        added if discovery reports them again.
        """
        expired = [h for h, t in self._until.items() if t <= now]
        if not expired:
            return ()                # every tick asks: O(blacklisted), not O(hosts seen)
        for h in expired:
            del self._until[h]
        self.version += 1
        return tuple(h for h in self._ordered(expired) if h in self._discovered)

    def all_blacklisted(self, now: float) -> bool:
        """True when hosts were discovered and every one of them is barred."""
        return bool(self._discovered) and all(
            self.is_blacklisted(h, now) for h in self._discovered)

    def next_return_time(self, now: float | None = None) -> float | None:
        """Earliest time a blacklisted host comes back; None if none ever will.

        Pass ``now`` to ignore cooldowns that already expired.
        """
        times = [t for t in self._until.values()
                 if not math.isinf(t) and (now is None or t > now)]
        return min(times) if times else None

    # -- helpers -------------------------------------------------------------

    def _remember(self, hosts: Iterable[str]) -> None:
        for h in hosts:
            self._seen.setdefault(h, None)

    def _ordered(self, hosts: Iterable[str]) -> list[str]:
        members = set(hosts)
        return [h for h in self._seen if h in members]
