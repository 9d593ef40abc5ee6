"""Authenticated access to the driver's TCPStore, the control plane.

Anyone who can reach the store's port can read and write keys, so every key
lives under a namespace derived from the job secret, and every value that
steers the job (plans, registrations) carries an HMAC bound to its key.
Values are JSON, never pickles: nothing reachable from the network unpickles.
"""

import hashlib
import hmac
import json
import os
from datetime import timedelta

import torch.distributed as dist

from elastic.exceptions import ElasticError

ENV_ADDR = "ELASTIC_STORE_ADDR"
ENV_PORT = "ELASTIC_STORE_PORT"
ENV_SECRET = "ELASTIC_SECRET"
ENV_SECRET_FILE = "ELASTIC_SECRET_FILE"
ENV_WORKER_ID = "ELASTIC_WORKER_ID"

_MAC_LEN = 64  # hex digits of a sha256 HMAC


class ControlError(ElasticError):
    """A control-plane value failed authentication or could not be read."""


def read_secret_from_env():
    """Prefer a 0600 file so the secret never shows in the environment of ps."""
    path = os.environ.get(ENV_SECRET_FILE)
    if path:
        with open(path, "rb") as f:
            return f.read().strip()
    secret = os.environ.get(ENV_SECRET)
    if not secret:
        raise ControlError("no job secret: set by elasticrun for its workers")
    return secret.encode()


def connect(addr, port, timeout_s, is_master=False):
    """One TCPStore connection (the driver passes is_master=True)."""
    return dist.TCPStore(
        addr, int(port), is_master=is_master, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False, use_libuv=True,
    )


class ControlStore:
    """Signed JSON values and plain counters under the job's secret namespace."""

    def __init__(self, store, secret):
        if isinstance(secret, str):
            secret = secret.encode()
        self._secret = secret
        namespace = hmac.new(secret, b"elastic-namespace", hashlib.sha256).hexdigest()[:32]
        self.raw = dist.PrefixStore(namespace + "/", store)

    def _mac(self, key, payload):
        return hmac.new(self._secret, key.encode() + b"\0" + payload, hashlib.sha256).hexdigest()

    def put(self, key, value):
        payload = json.dumps(value, sort_keys=True).encode()
        self.raw.set(key, self._mac(key, payload).encode() + payload)

    def get(self, key):
        """The verified value of ``key``, or None when it is not set yet."""
        if not self.raw.check([key]):
            return None
        blob = bytes(self.raw.get(key))
        mac, payload = blob[:_MAC_LEN], blob[_MAC_LEN:]
        if not hmac.compare_digest(mac, self._mac(key, payload).encode()):
            raise ControlError(f"control key {key!r} failed authentication")
        return json.loads(payload)

    def has(self, key):
        return self.raw.check([key])

    def add(self, key, amount=1):
        return int(self.raw.add(key, amount))

    def counter(self, key):
        return self.add(key, 0)


class Keys:
    """Every control-plane key in one place, so driver and worker agree."""

    LATEST_ROUND = "round/latest"

    @staticmethod
    def plan(round_id):
        return f"round/{round_id}/plan"

    @staticmethod
    def abort(round_id):
        return f"round/{round_id}/abort"

    @staticmethod
    def joined(round_id):
        return f"round/{round_id}/joined"

    @staticmethod
    def failures(round_id):
        """Counter that workers bump when a collective of this round failed."""
        return f"round/{round_id}/failures"

    @staticmethod
    def pause(round_id):
        """How long training stood still before this round resumed (rank 0 reports)."""
        return f"round/{round_id}/pause"

    @staticmethod
    def ready(worker_id):
        return f"worker/{worker_id}/ready"

    @staticmethod
    def heartbeat(worker_id):
        return f"worker/{worker_id}/heartbeat"

    @staticmethod
    def done(worker_id):
        return f"worker/{worker_id}/done"

    @staticmethod
    def progress(worker_id):
        return f"worker/{worker_id}/progress"

    @staticmethod
    def process_group(round_id):
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
