"""Exit bookkeeping: what a worker's exit means for the job. Pure functions."""

from enum import Enum


class ExitKind(Enum):
    FINISHED = "finished"      # trained to the end in its round
    REMOVED = "removed"        # left because the new round no longer had it
    FAILED = "failed"          # non-zero exit: its host gets blacklisted
    STOPPED = "stopped"        # killed by the driver on purpose (eviction, cleanup)


def classify_exit(code, *, stopped_by_driver, in_current_round, reported_done, ever_member,
                  never_joined=False):
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
    if ever_member:
        return ExitKind.REMOVED
    # Exited 0 before ever joining a round: nothing was trained, so not a finish.
    return ExitKind.REMOVED


def final_outcome(final_codes):
    """Success only when every worker of the final round exited 0."""
    failed = {wid: code for wid, code in final_codes.items() if code != 0}
    return not failed, failed
