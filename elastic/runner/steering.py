"""elasticctl's requests as the driver reads them, and the rules for steering a job.

A request is a sealed value (elastic/auth.py) under ``Keys.ctl_request(name)``, its
name rung on the ``Keys.CTL_INBOX`` doorbell; the answer is a sealed value under
``Keys.ctl_reply(name)``. Both are sealed with elasticctl's own key
(``protocol.ctl_key``, derived from the job secret): workers hold only their key, so
neither an outsider nor a compromised worker can write a request that verifies; a
forged one reads as absent and is ignored (and a wrong secret never gets an answer).
A name is acted on once: a request copied back into the store
later is not obeyed again. There is no socket or protocol beyond the control store.

The rules (``drain_refusal``, ``resize_refusal``) are pure, tested in
tests/test_ctl.py without processes; what a steered job does next is
``policy.decide``'s, from ``Facts.drained`` and ``Limits.max_np`` (tests/test_decide.py).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from elastic.protocol import Doorbell, Keys, ctl_key

if TYPE_CHECKING:
    from typing import TypeGuard  # Python 3.10's: a hint only

    from elastic.control_store import ControlStore
    from elastic.runner.control_plane import DriverControl

LOOK_S = 0.2               # how often the driver looks at the inbox
NAMES_PER_LOOK = 256       # more than this per look is a flood: the rest wait for a re-ring
REPLY_KEPT_S = 60.0        # an answer nobody collected is deleted after this
STATUS_NAMES_KEPT = 4096   # status names remembered (steering names are all remembered)
INBOX_RESET_AFTER = 256    # names read before the inbox key is emptied (clients re-ring)
OPS = ("status", "drain", "stop", "resize")
STEERING = ("drain", "stop", "resize")


def drain_refusal(host: str, slots: Mapping[str, int], drained: Collection[str],
                  min_np: int) -> str | None:
    """Why ``host`` cannot be drained now (None: it can). ``slots``: host -> slots the
    job may use (discovered, not blacklisted); ``drained``: hosts drained already."""
    if host not in slots and host not in drained:
        known = ", ".join(sorted(slots)) or "none"
        return f"host {host!r} is not one of the job's hosts ({known})"
    left = sum(n for h, n in slots.items() if h != host and h not in drained)
    if left < min_np:
        return (f"draining {host} would leave {left} slots, fewer than --min-np {min_np}; "
                f"not drained")
    return None


def resize_refusal(max_np: object, min_np: int) -> str | None:
    """Why --max-np cannot become ``max_np`` (None: it can)."""
    if isinstance(max_np, bool) or not isinstance(max_np, int) or max_np < 1:
        return f"--max-np must be a whole number of at least 1, got {max_np!r}"
    if max_np < min_np:
        return f"--max-np {max_np} is smaller than the job's --min-np {min_np}"
    return None


def well_formed(request: object) -> TypeGuard[dict[str, Any]]:
    """Whether a verified request has a known op and the arguments that op needs."""
    if not isinstance(request, dict) or request.get("op") not in OPS:
        return False
    op = request["op"]
    if op == "drain":
        return isinstance(request.get("host"), str) and 0 < len(request["host"]) <= 255
    if op == "resize":
        return "max_np" in request
    return True


def open_inbox(plane: DriverControl, secret: str) -> Inbox:
    """The driver's inbox, on values sealed with elasticctl's key derived from the job
    ``secret`` (``plane``: the driver's control_plane.DriverControl). Its sealed hello
    lets elasticctl tell a wrong secret at once."""
    control = plane.sealed_with(ctl_key(secret))
    control.put(Keys.CTL_HELLO, {"pid": os.getpid()}, keep=True)
    return Inbox(control)


class Inbox:
    """The driver's end: new requests that verify, each once, and their answers."""

    def __init__(self, control: ControlStore) -> None:
        self.control = control
        self._bell = Doorbell(control, Keys.CTL_INBOX)
        self._looked_at = float("-inf")
        self._status_names: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._steering_names: set[str] = set()
        self._replies: collections.deque[tuple[float, str]] = collections.deque()  # (when, name)
        self._read_since_reset = 0
        self.ignored = 0                          # names rung that did not verify

    def poll(self, now: float) -> list[tuple[str, dict[str, Any]]]:
        """[(name, request)] of the verified requests rung since the last look."""
        if now - self._looked_at < LOOK_S:
            return []
        self._looked_at = now
        self._drop_old_replies(now)
        names = [n for n in dict.fromkeys(self._bell.new_names())
                 if n not in self._status_names and n not in self._steering_names]
        names = names[:NAMES_PER_LOOK]
        if not names:
            return []
        self._read_since_reset += len(names)
        found = self.control.get_present(Keys.ctl_request(n) for n in names)
        requests = []
        for name in names:
            request = found.get(Keys.ctl_request(name))
            if not well_formed(request):
                self.ignored += 1       # forged, garbage, or not written yet (clients re-ring)
                continue
            self._remember(name, request["op"])
            self.control.delete(Keys.ctl_request(name))
            requests.append((name, request))
        if self._read_since_reset >= INBOX_RESET_AFTER:
            self._read_since_reset = 0
            self.control.delete(Keys.CTL_INBOX)      # bounded; a name rung meanwhile re-rings
        return requests

    def reply(self, name: str, value: Any, now: float) -> None:
        self.control.put(Keys.ctl_reply(name), value)
        self._replies.append((now, name))

    def _remember(self, name: str, op: str) -> None:
        if op in STEERING:
            self._steering_names.add(name)            # rare (people type them): kept for good
            return
        self._status_names[name] = None
        while len(self._status_names) > STATUS_NAMES_KEPT:
            self._status_names.popitem(last=False)

    def _drop_old_replies(self, now: float) -> None:
        while self._replies and now - self._replies[0][0] > REPLY_KEPT_S:
            _, name = self._replies.popleft()
            self.control.delete(Keys.ctl_reply(name))
