"""Resuming: the newest checkpoint that loads, and never a silent start from scratch.

A checkpoint that verifies may still be unusable here: written in a newer format, its
objects no longer unpickle (a renamed class, a library upgrade), or it does not fit the
state (another model or optimizer: ``load_state_dict`` refuses it). What a rerun does
then is a choice (``Checkpointer(unusable=...)``, elasticrun ``--on-unusable-checkpoint``):

* ``previous`` (the default): resume from the newest checkpoint that loads, with one
  warning naming both; when none loads, refuse (below).
* ``stop``: refuse with one line naming the unusable checkpoint.

Refusing stops the job with one line and blames no host (worker/fatal.py): it would fail
the same way on any host. Unusable checkpoints are never renamed or deleted, and the
resumed state takes the version of the newest checkpoint on disk, so every later write
lands above them: an unusable checkpoint is never buried under newer-numbered writes
that a later rerun would again skip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic import protocol
from elastic.checkpoint import format as store
from elastic.exceptions import ElasticError

if TYPE_CHECKING:
    from elastic.checkpoint.format import Warn
    from elastic.state.states import State

CHOICES = ("previous", "stop")


class Refused(ElasticError):
    """No checkpoint to resume from although some exist (str(): the one line)."""


def choice(value: str | None) -> str:
    """The --on-unusable-checkpoint choice; ValueError names a bad one."""
    value = value or "previous"
    if value not in CHOICES:
        raise ValueError(f"--on-unusable-checkpoint ({protocol.ENV_CHECKPOINT_UNUSABLE}) must "
                         f"be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def newest_usable(directory: str, state: State, unusable: str, warn: Warn,
                  quarantine: bool = False) -> tuple[int, str, int] | None:
    """Adopt the newest checkpoint of ``directory`` that loads into ``state``; returns
    (its version, its path, the version now adopted: the newest on disk) or None when
    there is none. Raises Refused when checkpoints exist but none may be used."""
    on_disk = store.list_checkpoints(directory)
    if not on_disk:
        return None
    newest = on_disk[-1][0]
    skipped = []              # (path, why) of unusable checkpoints, newest first

    def note(_version: int, path: str, exc: Exception | str) -> None:
        skipped.append((path, str(exc)))

    for version, tree, path in store.candidates(directory, warn, quarantine, note):
        if skipped and unusable == "stop":
            break
        try:
            state.adopt(tree, max(version, newest))
        except Exception as exc:  # noqa: BLE001 - load_state_dict: another model or optimizer
            note(version, path, f"it does not fit this state: {exc.__class__.__name__}: "
                                f"{' '.join(str(exc).split())[:300]}")
            if unusable == "stop":
                break
            continue
        if skipped:
            warn(f"checkpoint {skipped[0][0]} cannot be used ({skipped[0][1]}); resumed from "
                 f"{path} instead, the newest that loads ({len(skipped)} skipped, none "
                 "renamed; --on-unusable-checkpoint stop refuses instead)")
        return version, path, max(version, newest)
    if not skipped:
        return None           # every one was corrupt (quarantined, warned) or unreadable
    path, why = skipped[0]
    if unusable == "stop":
        raise Refused(f"checkpoint {path} cannot be used ({why}); not resuming from an older "
                      "one (--on-unusable-checkpoint stop)")
    raise Refused(f"no checkpoint in {directory} can be used (the newest, {path}: {why}); "
                  "refusing to start from scratch: fix the script, or move the checkpoints "
                  "away to start over")
