"""The driver-worker contract: environment names, store keys, membership <-> env,
and authenticated access to the driver's TCPStore (the control plane).

Everything both sides must agree on is defined here once. The stdlib-only
``elastic/runner/remote.py`` keeps its own copy of the few names it needs;
``tests/test_remote.py`` checks that they agree.

Anyone who can reach the store's port can list, read, write and delete keys
(the namespace below only keeps jobs apart). So every value anyone acts on is
sealed (elastic/auth.py): bound to the job, its key and a sequence number. A
value that does not verify, or an older one replayed, reads as absent, with
one rate-limited warning; forgery is never fatal. There are no counters: an
outsider could bump them, and ``add`` on a key holding a non-number closes the
store connection. Values are JSON, never pickles: nothing reachable from the
network unpickles.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import json
import os
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elastic.auth import Rejected, Sealer, WarnOnce, stderr_warning
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
ENV_SIZE = "ELASTIC_SIZE"
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

# -- how often waiting workers look at the store ------------------------------------------
# Waiting members of a round of ``size`` look at one small key each pause; the pause grows
# with the size so that the store sees at most about STORE_LOOKS_PER_S looks per second
# from all of them together (a 4-worker round still looks every few ms).
STORE_LOOKS_PER_S = 10000.0


def poll_pause(size: int, waited: float, first: float = 0.005, longest: float = 0.1) -> float:
    """Seconds to sleep before the next look, after ``waited`` seconds of waiting."""
    return max(size / STORE_LOOKS_PER_S, min(longest, max(first, waited / 4)))


def encode_ids(ids) -> list:
    """Worker ids as a short list: decimal ids as sorted [first, count] runs of
    consecutive ids (a job's members are mostly consecutive), any other id as
    itself."""
    runs, names = [], []
    for wid in ids:
        (runs if str(wid).isdecimal() else names).append(str(wid))
    out = []
    for n in sorted({int(i) for i in runs}):
        if out and out[-1][0] + out[-1][1] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return out + sorted(set(names))


def ids_contain(encoded, worker_id) -> bool:
    """Whether the list of encode_ids holds ``worker_id``."""
    wid = str(worker_id)
    if not wid.isdecimal():
        return wid in encoded
    n = int(wid)
    runs = [r for r in encoded if isinstance(r, list)]
    i = bisect.bisect_right([r[0] for r in runs], n) - 1
    return i >= 0 and n < runs[i][0] + runs[i][1]


def decode_ids(encoded) -> list:
    return [str(r[0] + k) if isinstance(r, list) else r
            for r in encoded for k in (range(r[1]) if isinstance(r, list) else (0,))]


_CHUNK = 512            # keys per check / multi_get in get_present
_SMALL_CHUNK = 32       # ... below which a chunk with a missing key is read key by key
_REPLAY_MEMORY = 1 << 16  # keys whose highest accepted sequence number is remembered


class ControlError(ElasticError):
    """The job secret is missing, or the control store cannot be reached."""


def read_secret_from_env(environ: Mapping[str, str] | None = None) -> bytes:
    """Prefer a 0600 file so the secret never shows in the environment of ps."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_SECRET_FILE)
    if path:
        with open(path, "rb") as f:
            return f.read().strip()
    secret = env.get(ENV_SECRET)
    if not secret:
        raise ControlError("no job secret: set by elasticrun for its workers")
    return secret.encode()


def connect(addr: str, port: int | str, timeout_s: float, is_master: bool = False) -> dist.TCPStore:
    """One TCPStore client connection (the driver's store: see listen())."""
    return dist.TCPStore(
        addr, int(port), is_master=is_master, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False, use_libuv=True,
    )


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

    def __init__(self, store: dist.Store, secret: bytes | str, warn=stderr_warning):
        if isinstance(secret, str):
            secret = secret.encode()
        namespace = hmac.new(secret, b"elastic-namespace", hashlib.sha256).hexdigest()[:32]
        self.raw = dist.PrefixStore(namespace + "/", store)
        self.sealer = Sealer(secret, job=namespace)
        self.rejected = WarnOnce(warn)
        self._highest = {}
        self._kept = {}
        self.requests = 0       # store round trips and bytes read, for make scale
        self.bytes_read = 0

    def put(self, key, value, keep=False):
        blob = self.sealer.seal(key, json.dumps(value, sort_keys=True).encode())
        if keep:
            self._kept[key] = blob
        self.requests += 1
        self.raw.set(key, blob)

    def put_many(self, values, keep=False):
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

    def forget(self, key):
        """Stop healing ``key`` (its value stays)."""
        self._kept.pop(key, None)

    def delete(self, key):
        """Remove ``key`` from the store (and stop healing it)."""
        self._kept.pop(key, None)
        self.requests += 1
        self.raw.delete_key(key)

    def get(self, key):
        """The verified value of ``key``; None when absent, forged or replayed."""
        self.requests += 1
        if not self.raw.check([key]):
            return None
        self.requests += 1
        blob = bytes(self.raw.get(key))
        self.bytes_read += len(blob)
        return self._verify(key, blob)

    def get_many(self, keys):
        """{key: verified value or None}, in one round trip when all exist."""
        keys = list(keys)
        found = self.get_present(keys)
        return {k: found.get(k) for k in keys}

    def get_present(self, keys):
        """{key: verified value} for those of ``keys`` that hold one."""
        found = {}
        for key, blob in self.raw_present(keys).items():
            value = self._verify(key, blob)
            if value is not None:
                found[key] = value
        return found

    def raw_present(self, keys):
        """{key: stored bytes} for those of ``keys`` that exist, unverified.

        Asks about whole chunks at once and splits only a chunk where some key
        is missing, so reading n keys of which m are missing takes about
        n / CHUNK + m·log(CHUNK) round trips, not n."""
        keys = list(keys)
        blobs = {}
        for i in range(0, len(keys), _CHUNK):
            self._read_chunk(keys[i:i + _CHUNK], blobs)
        return blobs

    def _read_chunk(self, keys, blobs):
        if not keys:
            return
        self.requests += 1
        if self.raw.check(keys):
            self.requests += 1
            got = self.raw.multi_get(keys) if len(keys) > 1 else [self.raw.get(keys[0])]
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

    def has(self, key):
        return self.get(key) is not None

    def keys(self):
        """Every key under the job's namespace (what any client can list too)."""
        return list(self.raw.list_keys())

    def present(self, key):
        """Whether anything at all is stored under ``key`` (verified or not)."""
        self.requests += 1
        return self.raw.check([key])

    def heal(self):
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

    def _verify(self, key, blob):
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

    def __init__(self, store: ControlStore, key: str):
        self.store, self.key = store, key
        self._offset = 0

    def ring(self, name: str) -> None:
        self.store.requests += 1
        self.store.raw.append(self.key, f"{name}\n".encode())

    def new_names(self) -> list:
        """Names rung since the last call (all of them again if the list was rewritten)."""
        if not self.store.present(self.key):
            self._offset = 0
            return []
        self.store.requests += 1
        blob = bytes(self.store.raw.get(self.key))
        self.store.bytes_read += len(blob)
        if len(blob) < self._offset:
            self._offset = 0
        end = blob.rfind(b"\n") + 1
        if end <= self._offset:
            return []
        fresh, self._offset = blob[self._offset:end], end
        return [n for n in fresh.decode("ascii", "replace").split("\n") if 0 < len(n) <= 64]


class Keys:
    """Every control-plane key in one place, so driver and worker agree."""

    LATEST_ROUND = "round/latest"
    REGISTERED = "workers/registered"      # Doorbell: workers that put their ready key

    @staticmethod
    def plan(round_id: int | str) -> str:
        """The round's header: {"round", "size", "ids"}; ``ids`` holds the member ids as
        runs (encode_ids), so a worker learns whether it is a member in O(runs) bytes."""
        return f"round/{round_id}/plan"

    @staticmethod
    def member(round_id: int | str, worker_id: int | str) -> str:
        """One member's dict (rank, local and cross ranks, host): read by that member only."""
        return f"round/{round_id}/member/{worker_id}"

    @staticmethod
    def assembled(round_id: int | str) -> str:
        """The driver's word on the round's assembly: {"ok": true} once every member
        arrived, {"ok": false} if it was aborted first. Members wait on this one key."""
        return f"round/{round_id}/assembled"

    @staticmethod
    def abort(round_id: int | str) -> str:
        return f"round/{round_id}/abort"

    @staticmethod
    def joined(round_id: int | str, worker_id: int | str) -> str:
        """A member arrived at the round (each member waits for all of them)."""
        return f"round/{round_id}/joined/{worker_id}"

    @staticmethod
    def arrivals(round_id: int | str) -> str:
        """Doorbell: members that put their joined key in this round."""
        return f"round/{round_id}/arrivals"

    @staticmethod
    def failures(round_id: int | str) -> str:
        """Doorbell: the last worker that saw a collective of this round fail."""
        return f"round/{round_id}/failures"

    @staticmethod
    def failed(round_id: int | str, worker_id: int | str) -> str:
        """Each worker's own report that a collective of this round failed."""
        return f"round/{round_id}/failed/{worker_id}"

    @staticmethod
    def pause(round_id: int | str) -> str:
        """How long training stood still before this round resumed (rank 0 reports)."""
        return f"round/{round_id}/pause"

    @staticmethod
    def ready(worker_id: int | str) -> str:
        return f"worker/{worker_id}/ready"

    @staticmethod
    def heartbeat(worker_id: int | str) -> str:
        """Signed JSON: a beat count and the training thread's progress (liveness.py)."""
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

    # -- stopping, leaving and liveness (issue 10) -----------------------------------------
    STOP = "job/stop"

    @staticmethod
    def leaving(worker_id):
        """Set by a worker that got SIGTERM: it leaves at its next commit (preempted)."""
        return f"worker/{worker_id}/leaving"


# -- joining agents (elasticrun --serve / --join) ---------------------------------------------

HELLO_KEY = "elastic/serve/hello"   # raw, outside the namespace: lets a wrong secret be told apart


def serve_proof(secret, nonce):
    """What a serving driver publishes with ``nonce``: an agent holding the same
    secret recomputes it, so a wrong --secret-file is refused at once."""
    if isinstance(secret, str):
        secret = secret.encode()
    return hmac.new(secret, b"elastic-serve\0" + nonce.encode(), hashlib.sha256).hexdigest()


def agent_name(secret, token):
    """An agent's name in the store: a random token and its tag, an HMAC of the token.

    Agents never claim a shared counter or slot an outsider could squat ahead of
    them: each picks a fresh random token, and the hub finds registrations by
    listing keys, keeping only names whose tag verifies (an outsider's fake
    names are dropped without a store read)."""
    if isinstance(secret, str):
        secret = secret.encode()
    tag = hmac.new(secret, b"elastic-agent\0" + token.encode(), hashlib.sha256).hexdigest()[:16]
    return f"{token}-{tag}"


def is_agent_name(secret, name):
    token, sep, _ = name.rpartition("-")
    return bool(sep) and hmac.compare_digest(agent_name(secret, token), name)


class AgentKeys:
    """Keys between a serving driver and its joining agents, all signed, each under the
    agent's name (agent_name)."""

    FINISHED = "serve/finished"        # the driver's goodbye: agents exit
    PREFIX = "agent/"

    @staticmethod
    def bye(name):
        """The agent saw FINISHED and stops: the driver may exit."""
        return f"agent/{name}/bye"

    @staticmethod
    def info(name):
        """{"host", "slots", "pid"}: the agent's registration."""
        return f"agent/{name}/info"

    @staticmethod
    def registered(key):
        """The agent name in an ``info`` key (as list_keys shows it), else None."""
        if key.startswith(AgentKeys.PREFIX) and key.endswith("/info"):
            name = key[len(AgentKeys.PREFIX):-len("/info")]
            return name if name and "/" not in name else None
        return None

    @staticmethod
    def accepted(name):
        """{"ok": true} or {"ok": false, "reason": ...}: the driver's answer."""
        return f"agent/{name}/accepted"

    @staticmethod
    def beat(name):
        """{"seq", "draining", "received"}: the agent is alive, whether it is leaving, and
        how many requests it has read (those may go)."""
        return f"agent/{name}/beat"

    @staticmethod
    def request(name, seq):
        """Driver -> agent, in order: {"op": "spawn"|"kill", "worker_id", ...}."""
        return f"agent/{name}/to/{seq}"

    @staticmethod
    def read(name):
        """{"reports": n}: the driver has read the agent's reports up to n (they may go)."""
        return f"agent/{name}/read"

    @staticmethod
    def report(name, seq):
        """Agent -> driver, in order: {"out": [[worker, stream, line]], "exits": [[worker, code]]}."""
        return f"agent/{name}/from/{seq}"
