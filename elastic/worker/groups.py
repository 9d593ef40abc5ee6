"""Process groups of past rounds, freed once nothing can still touch them.

Each gloo group holds about 5 fds and 3 threads per rank (DESIGN §6), so a
long job must not keep every past round's group. Freeing one is safe only
once no work issued on it is still running: its destructor waits for that
work, and a collective abandoned on an aborted round may still wait on a
peer. So every group records the work issued on it (``TrackedGroup``), and a
retired group is released as soon as all its work has completed.

Work abandoned on an aborted round drains by itself: a peer that leaves the
round releases its own, idle group at once, which closes its connections,
which fails the work still waiting on it ("Connection closed by peer", within
milliseconds). The group's timeout is the backstop for a peer that never
closes (a stopped process is killed by the driver, which closes them too).
"""

import threading

import torch.distributed as dist


class TrackedGroup:
    """A process group that remembers its unfinished work.

    Forwards every method of the wrapped group; work objects it returns are
    recorded. ``group`` is the wrapped torch process group.
    """

    def __init__(self, group):
        self.group = group
        self._works = []
        self._mu = threading.Lock()

    def __getattr__(self, name):
        attr = getattr(self.group, name)
        if not callable(attr):
            return attr

        def issue(*args, **kwargs):
            result = attr(*args, **kwargs)
            if isinstance(result, dist.Work):
                self._record(result)
            return result

        return issue

    def _record(self, work):
        with self._mu:
            if len(self._works) >= 64:   # keeps the list short within a long round
                self._works = [w for w in self._works if not w.is_completed()]
            self._works.append(work)

    def drained(self):
        """True once no work issued on this group is still running."""
        with self._mu:
            self._works = [w for w in self._works if not w.is_completed()]
            return not self._works

    def pending(self):
        with self._mu:
            return sum(1 for w in self._works if not w.is_completed())


class RetiredGroups:
    """Groups of rounds this worker left, until their work has drained."""

    def __init__(self):
        self._groups = []
        self.released = 0        # groups freed so far
        self.waited = 0          # groups that still had work in flight when retired

    def retire(self, *groups):
        for group in groups:
            if group is not None and all(group is not g for g in self._groups):
                self._groups.append(group)
                self.waited += 0 if group.drained() else 1

    def release_drained(self):
        """Drop every retired group whose work has all completed; returns how many are left.

        The last reference goes here, so the group's destructor runs on this
        thread, and it returns at once: nothing is left for it to wait on.
        """
        if not self._groups:
            return 0
        keep = []
        for group in self._groups:
            if group.drained():
                self.released += 1
            else:
                keep.append(group)
        self._groups = keep
        return len(keep)

    def __len__(self):
        return len(self._groups)
