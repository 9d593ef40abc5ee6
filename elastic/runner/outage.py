"""What a restarted serving driver does about the time it was away (pure decisions).

A serving driver may die at any moment, also after training ended but before it saw
its workers exit. Its successor (the same command, the same ``--state-dir``) finds
what the first one kept there (state_dir.py: the newest round and its members, the
last commit and checkpoint known, the final round's exits) and what the agents that
come back report: their live workers, and the exit codes of those that ended,
marked unread when no driver read them. From that alone it decides:

* the job finished while the driver was away (every member of the newest round
  exited 0): exit 0, start nothing;
* the job needs nothing from it (nothing kept, or live workers hold the state):
  go on, adopting the live workers (adoption.py);
* work was committed but no worker survives: the holders rule (holders.py), never a
  silent restart from step 0: resume from the newest checkpoint when one exists,
  else stop with one line and a non-zero exit.

Until every host of the newest round has an agent back (or ``wait_s`` passed), a
driver with nothing live to adopt waits: an agent that is a beat late may still
bring live workers, or the exits that say the job finished.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

WAIT, GO, FINISHED, CHECKPOINT, LOST = "wait", "go", "finished", "checkpoint", "lost"


@dataclass(frozen=True)
class Kept:
    """What the previous driver kept in --state-dir about the job's progress."""

    round: int = 0
    members: Mapping = field(default_factory=dict)    # newest round: worker id -> host
    commit: int = -1
    durable: int = -1
    final_codes: Mapping = field(default_factory=dict)   # final-round exits it saw
    finished: bool = False                            # it saw the job finish (exit 0)


@dataclass(frozen=True)
class Back:
    """What the agents that registered with this driver reported."""

    hosts: frozenset = frozenset()        # hosts with an agent registered
    live: frozenset = frozenset()         # workers still running (adopted)
    codes: Mapping = field(default_factory=dict)   # worker id -> exit code of ended ones


@dataclass(frozen=True)
class Verdict:
    kind: str
    line: str = ""


def decide_outage(kept: Kept, back: Back, waited_s: float, wait_s: float) -> Verdict:
    """What to do now about the time the previous driver was away."""
    if kept.finished:
        return Verdict(FINISHED, f"the job in --state-dir already finished (the last commit "
                                 f"was {kept.commit}): nothing to start")
    if not kept.round or back.live:
        return Verdict(GO)
    missing = set(kept.members.values()) - set(back.hosts)
    if missing and waited_s < wait_s:
        return Verdict(WAIT)
    codes = {**kept.final_codes, **back.codes}
    if kept.members and all(codes.get(wid) == 0 for wid in kept.members):
        return Verdict(FINISHED, f"training finished while the driver was away: the "
                                 f"{len(kept.members)} worker(s) of round {kept.round} exited "
                                 f"0 (the last commit known was {kept.commit}); nothing to "
                                 "start")
    if kept.commit < 0:
        return Verdict(GO)                  # nothing committed: starting over loses nothing
    if kept.durable >= 0:
        return Verdict(CHECKPOINT, f"no surviving worker holds the training state (the last "
                                   f"commit was {kept.commit}); resuming from the newest "
                                   f"checkpoint (commit {kept.durable} or newer)")
    return Verdict(LOST, f"no surviving worker holds the training state; the last commit "
                         f"was {kept.commit}")


def blamed(codes: Mapping[str, int], unread: Collection[str], hosts: Mapping[str, str],
           ) -> list[tuple[str, str, int]]:
    """(worker id, host, code) of the workers that failed while no driver read their exit:
    each counts as a failure of that worker when the driver comes back."""
    return [(wid, hosts[wid], code) for wid, code in sorted(codes.items())
            if wid in unread and wid in hosts and code != 0]
