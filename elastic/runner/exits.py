"""Exit bookkeeping: what a worker's exit means for the job. Pure functions."""

from enum import Enum


class ExitKind(Enum):
    FINISHED = "finished"      # trained to the end in its round
    REMOVED = "removed"        # left because the new round no longer had it
    FAILED = "failed"          # non-zero exit: its host gets blacklisted
    STOPPED = "stopped"        # killed by the driver on purpose (eviction, cleanup)


def classify_exit(code: int, *, stopped_by_driver: bool, in_current_round: bool,
                  reported_done: bool, never_joined: bool = False) -> ExitKind:
    """Decide what one worker exit means.

    ``never_joined``: no round was ever formed and the worker never called
    elastic.init(); a plain script that ran to its end.
    """
    if stopped_by_driver:
        return ExitKind.STOPPED
    if code != 0:
        return ExitKind.FAILED
    if reported_done:
        return ExitKind.FINISHED
    if in_current_round or never_joined:
        # A plain script (no @elastic.run) ends by exiting 0 in its round.
        return ExitKind.FINISHED
    # Left the job (not in the new round), or exited 0 before joining one: nothing
    # was trained to the end, so not a finish.
    return ExitKind.REMOVED


def final_outcome(final_codes: dict) -> tuple[bool, dict]:
    """Success only when every worker of the final round exited 0."""
    failed = {wid: code for wid, code in final_codes.items() if code != 0}
    return not failed, failed
