"""The driver-worker contract: environment names, store keys, membership <-> env,
and authenticated access to the driver's TCPStore (the control plane).

Everything both sides must agree on is defined here once. The stdlib-only
``elastic/runner/remote.py`` keeps its own copy of the few names it needs;
``tests/test_remote.py`` checks that they agree.

Anyone who can reach the store's port can read and write keys, so every key
lives under a namespace derived from the job secret, and every value that
steers the job (plans, registrations) carries an HMAC bound to its key.
Values are JSON, never pickles: nothing reachable from the network unpickles.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elastic.exceptions import ElasticError

# -- environment the driver sets for its workers -------------------------------------------
ENV_ADDR = "ELASTIC_STORE_ADDR"              # the driver's TCPStore
ENV_PORT = "ELASTIC_STORE_PORT"
ENV_SECRET = "ELASTIC_SECRET"                # the job secret (local workers)
ENV_SECRET_FILE = "ELASTIC_SECRET_FILE"      # ... or a 0600 file holding it (remote workers)
ENV_WORKER_ID = "ELASTIC_WORKER_ID"
ENV_DRIVER_PID = "ELASTIC_DRIVER_PID"        # local workers exit if their parent is not it
ENV_ROUND_TIMEOUT = "ELASTIC_ROUND_TIMEOUT"  # seconds a worker waits for its next round
ENV_HEARTBEAT_INTERVAL = "ELASTIC_HEARTBEAT_INTERVAL"
ENV_CHECKPOINT_DIR = "ELASTIC_CHECKPOINT_DIR"  # --checkpoint-dir, for every TorchState

# -- environment a user or a test may set ---------------------------------------------------
ENV_STORE_TIMEOUT = "ELASTIC_STORE_TIMEOUT"
ENV_COLLECTIVE_TIMEOUT = "ELASTIC_COLLECTIVE_TIMEOUT"
ENV_SYNC_MAX_SENDERS = "ELASTIC_SYNC_MAX_SENDERS"  # most ranks that stripe one state sync
ENV_BACKEND = "ELASTIC_BACKEND"              # auto (NCCL when CUDA is there), gloo or nccl
ENV_SSH_LOOPBACK = "ELASTIC_SSH_LOOPBACK"     # 1: 127.0.0.2+ are remote (the ssh tests)
ENV_CHECKPOINT_LOCK_WAIT = "ELASTIC_CHECKPOINT_LOCK_WAIT"
ENV_CHECKPOINT_WRITE_TIMEOUT = "ELASTIC_CHECKPOINT_WRITE_TIMEOUT"
ENV_CHECKPOINT_RETRY = "ELASTIC_CHECKPOINT_RETRY"  # seconds between tries for a held lock
ENV_CHECKPOINT_TEST_HOLD = "ELASTIC_CHECKPOINT_TEST_HOLD"    # test hooks: slow a write down
ENV_CHECKPOINT_TEST_DELAY = "ELASTIC_CHECKPOINT_TEST_DELAY"

# -- membership <-> environment ---------------------------------------------------------------
MEMBERSHIP_FIELDS = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")
MEMBERSHIP_PREFIXES = ("ELASTIC", "HOROVOD")   # HOROVOD_* for scripts ported from Horovod
ENV_RANK = "ELASTIC_RANK"
ENV_HOSTNAME = "ELASTIC_HOSTNAME"


def membership_env(values: Mapping[str, Any], hostname: str) -> dict[str, str]:
    """The ELASTIC_* and HOROVOD_* variables for one membership.

    ``values`` maps each of MEMBERSHIP_FIELDS to an int (a plan's member dict,
    or a Membership's fields). The driver sets them before a worker's first
    round; the worker sets them again once it joins its first round, so they
    always describe the worker's first round.
    """
    env = {}
    for prefix in MEMBERSHIP_PREFIXES:
        for name in MEMBERSHIP_FIELDS:
            env[f"{prefix}_{name.upper()}"] = str(values[name])
        env[f"{prefix}_HOSTNAME"] = hostname
    return env


def rank_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """The rank the environment names (the worker's first round), or None."""
    value = (os.environ if environ is None else environ).get(ENV_RANK)
    return int(value) if value and value.isdigit() else None


def env_float(name: str, default: float, environ: Mapping[str, str] | None = None) -> float:
    """A float setting from the environment."""
    return float((os.environ if environ is None else environ).get(name, default))

_MAC_LEN = 64  # hex digits of a sha256 HMAC


class ControlError(ElasticError):
    """A control-plane value failed authentication or could not be read."""


def read_secret_from_env() -> bytes:
    """Prefer a 0600 file so the secret never shows in the environment of ps."""
    path = os.environ.get(ENV_SECRET_FILE)
    if path:
        with open(path, "rb") as f:
            return f.read().strip()
    secret = os.environ.get(ENV_SECRET)
    if not secret:
        raise ControlError("no job secret: set by elasticrun for its workers")
    return secret.encode()


def connect(addr: str, port: int | str, timeout_s: float, is_master: bool = False) -> dist.TCPStore:
    """One TCPStore connection (the driver passes is_master=True)."""
    return dist.TCPStore(
        addr, int(port), is_master=is_master, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False, use_libuv=True,
    )


class ControlStore:
    """Signed JSON values and plain counters under the job's secret namespace."""

    def __init__(self, store: dist.Store, secret: bytes | str):
        if isinstance(secret, str):
            secret = secret.encode()
        self._secret = secret
        namespace = hmac.new(secret, b"elastic-namespace", hashlib.sha256).hexdigest()[:32]
        self.raw = dist.PrefixStore(namespace + "/", store)

    def _mac(self, key: str, payload: bytes) -> str:
        return hmac.new(self._secret, key.encode() + b"\0" + payload, hashlib.sha256).hexdigest()

    def put(self, key: str, value: Any) -> None:
        payload = json.dumps(value, sort_keys=True).encode()
        self.raw.set(key, self._mac(key, payload).encode() + payload)

    def get(self, key: str) -> Any:
        """The verified value of ``key``, or None when it is not set yet."""
        if not self.raw.check([key]):
            return None
        blob = bytes(self.raw.get(key))
        mac, payload = blob[:_MAC_LEN], blob[_MAC_LEN:]
        if not hmac.compare_digest(mac, self._mac(key, payload).encode()):
            raise ControlError(f"control key {key!r} failed authentication")
        return json.loads(payload)

    def has(self, key: str) -> bool:
        return self.raw.check([key])

    def add(self, key: str, amount: int = 1) -> int:
        return int(self.raw.add(key, amount))

    def counter(self, key: str) -> int:
        return self.add(key, 0)


class Keys:
    """Every control-plane key in one place, so driver and worker agree."""

    LATEST_ROUND = "round/latest"

    @staticmethod
    def plan(round_id: int | str) -> str:
        return f"round/{round_id}/plan"

    @staticmethod
    def abort(round_id: int | str) -> str:
        return f"round/{round_id}/abort"

    @staticmethod
    def joined(round_id: int | str) -> str:
        return f"round/{round_id}/joined"

    @staticmethod
    def failures(round_id: int | str) -> str:
        """Counter that workers bump when a collective of this round failed."""
        return f"round/{round_id}/failures"

    @staticmethod
    def pause(round_id: int | str) -> str:
        """How long training stood still before this round resumed (rank 0 reports)."""
        return f"round/{round_id}/pause"

    @staticmethod
    def ready(worker_id: int | str) -> str:
        return f"worker/{worker_id}/ready"

    @staticmethod
    def heartbeat(worker_id: int | str) -> str:
        return f"worker/{worker_id}/heartbeat"

    @staticmethod
    def done(worker_id: int | str) -> str:
        return f"worker/{worker_id}/done"

    @staticmethod
    def progress(worker_id: int | str) -> str:
        return f"worker/{worker_id}/progress"

    @staticmethod
    def process_group(round_id: int | str) -> str:
        return f"pg/{round_id}/"


# -- joining agents (elasticrun --serve / --join) ---------------------------------------------

HELLO_KEY = "elastic/serve/hello"   # raw, outside the namespace: lets a wrong secret be told apart


def serve_proof(secret, nonce):
    """What a serving driver publishes with ``nonce``: an agent holding the same
    secret recomputes it, so a wrong --secret-file is refused at once."""
    if isinstance(secret, str):
        secret = secret.encode()
    return hmac.new(secret, b"elastic-serve\0" + nonce.encode(), hashlib.sha256).hexdigest()


class AgentKeys:
    """Keys between a serving driver and its joining agents (all signed but ``slot``,
    which an agent claims with compare_set before it registers)."""

    FINISHED = "serve/finished"        # the driver's goodbye: agents exit

    @staticmethod
    def bye(index):
        """The agent saw FINISHED and stops: the driver may exit."""
        return f"agent/{index}/bye"

    @staticmethod
    def slot(index):
        return f"agent/slot/{index}"

    @staticmethod
    def info(index):
        """{"host", "slots", "pid", "token"}: the agent's registration."""
        return f"agent/{index}/info"

    @staticmethod
    def accepted(index):
        """{"ok": true} or {"ok": false, "reason": ...}: the driver's answer."""
        return f"agent/{index}/accepted"

    @staticmethod
    def beat(index):
        """{"seq", "draining"}: the agent is alive (and whether it is leaving)."""
        return f"agent/{index}/beat"

    @staticmethod
    def request(index, seq):
        """Driver -> agent, in order: {"op": "spawn"|"kill", "worker_id", ...}."""
        return f"agent/{index}/to/{seq}"

    @staticmethod
    def report(index, seq):
        """Agent -> driver, in order: {"out": [[worker, stream, line]], "exits": [[worker, code]]}."""
        return f"agent/{index}/from/{seq}"
