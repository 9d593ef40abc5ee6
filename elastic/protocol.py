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

import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import Any

# The round's values in the store, typed (Member, RoundPlan, Assembled), and the member
# ids' short form: they are the contract, so they are named here with the rest of it.
from elastic.messages import (
    MEMBERSHIP_FIELDS,
    Assembled,
    EncodedIds,
    Member,
    MessageError,
    RoundPlan,
    decode_ids,
    encode_ids,
    ids_contain,
)

# -- environment the driver sets for its workers -------------------------------------------
ENV_ADDR = "ELASTIC_STORE_ADDR"              # the driver's TCPStore
ENV_PORT = "ELASTIC_STORE_PORT"
# ENV_SECRET (the job secret, local workers) and ENV_SECRET_FILE (a 0600 file holding
# it, remote workers) come from control_store.py, which reads them.
ENV_WORKER_ID = "ELASTIC_WORKER_ID"
ENV_DRIVER_PID = "ELASTIC_DRIVER_PID"        # local workers exit if their parent is not it
ENV_DRIVER_GRACE = "ELASTIC_DRIVER_GRACE"    # joining mode: workers outlive the driver (agent decides)
ENV_AGENT_ALLOW_ENV = "ELASTIC_AGENT_ALLOW_ENV"   # agents: spawn variables let through (runner/spawn_env.py)
ENV_ROUND_TIMEOUT = "ELASTIC_ROUND_TIMEOUT"  # seconds a worker waits for its next round
ENV_HEARTBEAT_INTERVAL = "ELASTIC_HEARTBEAT_INTERVAL"
ENV_CHECKPOINT_DIR = "ELASTIC_CHECKPOINT_DIR"  # --checkpoint-dir, for every TorchState
ENV_ERROR_DIR = "ELASTIC_ERROR_DIR"          # a worker's uncaught exception: DIR/worker.<id>/error.json

# -- environment a user or a test may set ---------------------------------------------------
ENV_STORE_TIMEOUT = "ELASTIC_STORE_TIMEOUT"
ENV_COLLECTIVE_TIMEOUT = "ELASTIC_COLLECTIVE_TIMEOUT"
ENV_SYNC_MAX_SENDERS = "ELASTIC_SYNC_MAX_SENDERS"  # most ranks that stripe one state sync
ENV_BACKEND = "ELASTIC_BACKEND"              # auto (NCCL when CUDA is there), gloo or nccl
ENV_SSH_LOOPBACK = "ELASTIC_SSH_LOOPBACK"     # 1: 127.0.0.2+ are remote (the ssh tests)
ENV_CHECKPOINT_LOCK_WAIT = "ELASTIC_CHECKPOINT_LOCK_WAIT"
ENV_CHECKPOINT_WRITE_TIMEOUT = "ELASTIC_CHECKPOINT_WRITE_TIMEOUT"
ENV_CHECKPOINT_RETRY = "ELASTIC_CHECKPOINT_RETRY"  # seconds between tries for a held lock
ENV_CHECKPOINT_UNUSABLE = "ELASTIC_CHECKPOINT_UNUSABLE"  # --on-unusable-checkpoint
EXIT_STOP_JOB = 78     # a worker found an error of the job, not of its host (Keys.fatal says it)
ENV_CHECKPOINT_TEST_HOLD = "ELASTIC_CHECKPOINT_TEST_HOLD"    # test hooks: slow a write down
ENV_CHECKPOINT_TEST_DELAY = "ELASTIC_CHECKPOINT_TEST_DELAY"
ENV_JOBS_DIR = "ELASTIC_JOBS_DIR"            # where drivers leave job files for elasticctl

# -- membership <-> environment ---------------------------------------------------------------
MEMBERSHIP_PREFIXES = ("ELASTIC", "HOROVOD")   # HOROVOD_* for scripts ported from Horovod
ENV_RANK = "ELASTIC_RANK"
ENV_SIZE = "ELASTIC_SIZE"
ENV_HOSTNAME = "ELASTIC_HOSTNAME"


def membership_env(values: Mapping[str, Any], hostname: str) -> dict[str, str]:
    """The ELASTIC_* and HOROVOD_* variables for one membership.

    ``values`` maps each of MEMBERSHIP_FIELDS to an int (``Member.to_json()``,
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


# HEAL_EVERY_S: how often a process puts back the values it keeps in the store where an
# outsider overwrote them. A waiting worker's rarer looks (is its round aborted, is there
# a newer one, is the job stopping, are its kept values intact) are backstops: the look
# above answers first. They cost several requests each, so in a big round they slow
# down until all members make about BACKSTOP_LOOKS_PER_S of them (every 2 s at 4,096).
HEAL_EVERY_S = 0.5
BACKSTOP_LOOKS_PER_S = 2000.0


def backstop_pause(size: int) -> float:
    """Seconds between a waiting member's backstop looks in a round of ``size``."""
    return max(HEAL_EVERY_S, size / BACKSTOP_LOOKS_PER_S)


# The store connection itself (sealed values, chunked reads, doorbells) lives in
# control_store.py; its names are part of the contract, so they are named here too.
from elastic.control_store import (  # noqa: E402
    ENV_SECRET,
    ENV_SECRET_FD,
    ENV_SECRET_FILE,
    ControlError,
    ControlStore,
    Doorbell,
    connect,
    keepalive_on_accepted,
    listen,
    open_link,
    read_secret_from_env,
)
from elastic.store_link import RECONNECT_WITHIN_S, driver_refuses  # noqa: E402

__all__ = ["MEMBERSHIP_FIELDS", "Assembled", "EncodedIds", "Member", "MessageError", "RoundPlan",
           "decode_ids", "encode_ids", "ids_contain",
           "ENV_SECRET", "ENV_SECRET_FD", "ENV_SECRET_FILE", "ControlError", "ControlStore", "Doorbell",
           "connect", "keepalive_on_accepted", "listen", "open_link", "read_secret_from_env",
           "RECONNECT_WITHIN_S", "driver_refuses"]


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
    def state_spec(kind: str) -> str:
        """Signed JSON {"flats": [[dtype, numel], ...]}: the flat buffers of the newest
        commit's snapshot of a State class, put by rank 0 when they change, so that a
        newcomer allocates and touches its receive buffers before it is admitted
        (elastic/state/states.py, ``State._reserve_for_sync``)."""
        return f"state/{kind}/spec"

    @staticmethod
    def fatal(worker_id: int | str) -> str:
        """The one line of an error that stops the job, not a host fault (worker/fatal.py)."""
        return f"worker/{worker_id}/fatal"

    @staticmethod
    def leaving(worker_id: int | str) -> str:
        """Set by a worker that got SIGTERM: it leaves at its next commit (preempted)."""
        return f"worker/{worker_id}/leaving"

    # -- elasticctl: status and steering (issue 30) -------------------------------------------
    CTL_HELLO = "ctl/hello"                # the driver's sealed {"pid"}: the secret is right
    CTL_INBOX = "ctl/inbox"                # Doorbell: names of elasticctl's requests

    @staticmethod
    def ctl_request(name: str) -> str:
        """Sealed {"op": "status"|"drain"|"stop"|"resize", ...} from elasticctl."""
        return f"ctl/request/{name}"

    @staticmethod
    def ctl_reply(name: str) -> str:
        """The driver's sealed answer to request ``name``."""
        return f"ctl/reply/{name}"


# -- joining agents (elasticrun --serve / --join) ---------------------------------------------

HELLO_KEY = "elastic/serve/hello"   # raw, outside the namespace: lets a wrong secret be told apart


def worker_key(secret: str | bytes) -> str:
    """The secret workers hold: derived from the job secret, which only the driver and
    the agents hold. Workers' keys live in its namespace and carry its seals; an
    agent obeys only requests sealed with the job secret, so a compromised worker
    cannot make agents start anything."""
    if isinstance(secret, str):
        secret = secret.encode()
    return hmac.new(secret, b"elastic-worker-key", hashlib.sha256).hexdigest()


def ctl_key(secret: str | bytes) -> str:
    """The key elasticctl seals its requests with: derived from the job secret under a
    label of its own. Workers hold only ``worker_key``, so a compromised worker cannot
    drain, stop or resize the job (the driver reads requests only under this key)."""
    if isinstance(secret, str):
        secret = secret.encode()
    return hmac.new(secret, b"elastic-ctl-key", hashlib.sha256).hexdigest()


def job_keys(secret: str) -> tuple[str, str]:
    """(the job secret, the workers' key)."""
    return secret, worker_key(secret)


def serve_proof(secret: str | bytes, nonce: str) -> str:
    """What a serving driver publishes with ``nonce``: an agent holding the same
    secret recomputes it, so a wrong --secret-file is refused at once."""
    if isinstance(secret, str):
        secret = secret.encode()
    return hmac.new(secret, b"elastic-serve\0" + nonce.encode(), hashlib.sha256).hexdigest()


def agent_name(secret: str | bytes, token: str) -> str:
    """An agent's name in the store: a random token and its tag, an HMAC of the token.

    Agents never claim a shared counter or slot an outsider could squat ahead of
    them: each picks a fresh random token, and the hub finds registrations by
    listing keys, keeping only names whose tag verifies (an outsider's fake
    names are dropped without a store read)."""
    if isinstance(secret, str):
        secret = secret.encode()
    tag = hmac.new(secret, b"elastic-agent\0" + token.encode(), hashlib.sha256).hexdigest()[:16]
    return f"{token}-{tag}"


def is_agent_name(secret: str | bytes, name: str) -> bool:
    token, sep, _ = name.rpartition("-")
    return bool(sep) and hmac.compare_digest(agent_name(secret, token), name)


class AgentKeys:
    """Keys between a serving driver and its joining agents, all signed, each under the
    agent's name (agent_name)."""

    FINISHED = "serve/finished"        # the driver's goodbye: agents exit
    PREFIX = "agent/"

    @staticmethod
    def bye(name: str) -> str:
        """The agent saw FINISHED and stops: the driver may exit."""
        return f"agent/{name}/bye"

    @staticmethod
    def info(name: str) -> str:
        """{"host", "slots", "pid"}: the agent's registration; after a driver restart also
        {"workers": {id: pid}, "nonce"}: the live workers a restarted driver adopts."""
        return f"agent/{name}/info"

    @staticmethod
    def registered(key: str) -> str | None:
        """The agent name in an ``info`` key (as list_keys shows it), else None."""
        if key.startswith(AgentKeys.PREFIX) and key.endswith("/info"):
            name = key[len(AgentKeys.PREFIX):-len("/info")]
            return name if name and "/" not in name else None
        return None

    @staticmethod
    def accepted(name: str) -> str:
        """{"ok": true} or {"ok": false, "reason": ...}: the driver's answer."""
        return f"agent/{name}/accepted"

    @staticmethod
    def beat(name: str) -> str:
        """{"seq", "draining", "received"}: the agent is alive, whether it is leaving, and
        how many requests it has read (those may go)."""
        return f"agent/{name}/beat"

    @staticmethod
    def ack(name: str) -> str:
        """{"seq"}: the driver read the agent's beat ``seq``: a fresh proof, which an
        outsider holding the port cannot forge, that the driver is there."""
        return f"agent/{name}/ack"

    @staticmethod
    def request(name: str, seq: int) -> str:
        """Driver -> agent, in order: {"op": "spawn"|"kill", "worker_id", ...}."""
        return f"agent/{name}/to/{seq}"

    @staticmethod
    def read(name: str) -> str:
        """{"reports": n}: the driver has read the agent's reports up to n (they may go)."""
        return f"agent/{name}/read"

    @staticmethod
    def report(name: str, seq: int) -> str:
        """Agent -> driver, in order: {"out": [[worker, stream, line]], "exits": [[worker, code]]}."""
        return f"agent/{name}/from/{seq}"
