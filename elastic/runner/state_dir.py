"""``elasticrun --serve --state-dir DIR``: what a restarted driver takes back.

A serving driver may be restarted (a pod rescheduled, a node lost) while its
agents keep the workers (runner/agent.py). Most of what it knew comes back from
them (runner/adoption.py): the live workers, their hosts and the newest round.
What only the driver knew is kept here, in one small JSON file replaced
atomically (write, fsync, rename) whenever it changes:

* the blacklist: each host's failure count and the cooldown left;
* the reset count (``--reset-limit`` keeps counting across a restart);
* the newest round published and the next worker id (also rebuilt from the
  workers; the file covers workers that died while the driver was away);
* the job's progress (outage.Kept): the newest round's members and hosts, the last
  commit and checkpoint workers reported, the final round's exits, and whether the
  job finished. A driver that comes back after every worker ended needs it to tell a
  finished job from a lost one (runner/outage.py).

The event log (``--event-log``) is appended to, so it needs no copy here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from elastic.runner.decisions import (
    Action,
    Finish,
    HostFailed,
    Job,
    NoteCommit,
    Publish,
    RecordExit,
    Spawn,
    StartFinishing,
)
from elastic.runner.outage import Kept

if TYPE_CHECKING:
    from elastic.runner.adoption import Adoption
    from elastic.runner.hosts import HostManager

log = logging.getLogger("elasticrun")
FILE = "driver-state.json"
Saved = tuple[int, int, int, dict]   # decode: (round, next_worker, resets, blacklist)


NOTED = (Publish, Spawn, HostFailed, NoteCommit, StartFinishing, RecordExit, Finish)


def encode(job: Job, hosts: HostManager, now: float, kept: Kept | None = None,
           finished: bool = False) -> dict[str, Any]:
    """The state a restarted driver needs, as a JSON-ready dict (pure). ``kept``: what
    the previous driver kept, still true until this one knows better."""
    kept = kept or Kept()
    members = {m.worker_id: m.host for m in job.members} or dict(kept.members)
    return {"version": 1, "round": job.round_id, "next_worker": job.next_worker,
            "resets": job.resets, "blacklist": hosts.export(now), "members": members,
            "commit": max(job.commit, kept.commit), "durable": max(job.durable, kept.durable),
            "final_codes": dict(job.final_codes) or dict(kept.final_codes),
            "finished": finished}


def decode_kept(data: object) -> Kept:
    """outage.Kept from ``encode``'s dict; what is missing or malformed reads as unknown."""
    if not isinstance(data, dict):
        return Kept()

    def number(name, default):
        value = data.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    def ids(name, kind):
        value = data.get(name)
        return {str(k): v for k, v in value.items() if isinstance(v, kind)} \
            if isinstance(value, dict) else {}
    return Kept(round=max(0, number("round", 0)), members=ids("members", str),
                commit=number("commit", -1), durable=number("durable", -1),
                final_codes=ids("final_codes", int), finished=data.get("finished") is True)


def decode(data: object) -> Saved:
    """(round, next_worker, resets, blacklist) from ``encode``'s dict; zeros for what
    is missing or malformed (a damaged file never stops the driver)."""
    if not isinstance(data, dict):
        return 0, 0, 0, {}

    def number(name):
        value = data.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
            else 0
    blacklist = data.get("blacklist")
    return (number("round"), number("next_worker"), number("resets"),
            blacklist if isinstance(blacklist, dict) else {})


def resume(saved: StateDir, job: Job, hosts: HostManager, adoption: Adoption,
           now: float) -> Job:
    """``job`` with what ``saved`` kept: the blacklist goes back into ``hosts``, the
    newest round becomes ``adoption``'s floor (the next round comes after it)."""
    floor, next_worker, resets, blacklist = saved.read_back()
    hosts.restore(blacklist, now)
    adoption.floor = max(adoption.floor, floor)
    if floor or next_worker or resets or blacklist:
        log.info("--state-dir: took back round %d, next worker id %d, %d resets, %d "
                 "blacklisted host(s)", floor, next_worker, resets, len(blacklist))
    return dataclasses.replace(job, next_worker=max(job.next_worker, next_worker),
                               resets=max(job.resets, resets))


class StateDir:
    """The file under --state-dir (nothing at all without one)."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self._written: str | None = None
        self.kept = decode_kept(self._read(warn=False))   # the previous driver's view of the job
        self.finished = False

    @property
    def path(self) -> str | None:
        return os.path.join(self.directory, FILE) if self.directory else None

    def read_back(self) -> Saved:
        """What the previous driver of this job left; zeros when nothing."""
        return decode(self._read())

    def _read(self, warn=True):
        if not self.directory:
            return None
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            if warn:
                log.warning("--state-dir: cannot read %s (%s); starting without it", self.path,
                            exc)
            return None

    def note(self, action: Action, job: Job, hosts: HostManager, now: float) -> None:
        """After an action: write the file if what it keeps changed."""
        path = self.path
        if path is None or not isinstance(action, NOTED):     # no --state-dir, or nothing kept
            return
        self.finished = self.finished or isinstance(action, Finish)
        data = encode(job, hosts, now, self.kept, self.finished)
        key = json.dumps({k: v for k, v in data.items() if k != "blacklist"}
                         | {"hosts": sorted(data["blacklist"])}, sort_keys=True)
        if key == self._written and not isinstance(action, HostFailed):
            return
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._written = key
        except OSError as exc:
            log.warning("--state-dir: cannot write %s: %s", self.path, exc)
