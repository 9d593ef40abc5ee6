"""A driver without processes for the tests of ``decide``: ``World`` carries actions out on
plain records (no processes, no store) and folds them into the job with ``evolve``."""

import dataclasses

from elastic.runner.decisions import (
    Exit,
    Facts,
    HostFailed,
    Job,
    Limits,
    Publish,
    Spawn,
    Stop,
    WorkerView,
    evolve,
)
from elastic.runner.hosts import HostManager
from elastic.runner.policy import decide


class World:
    """A driver without processes: workers are WorkerViews, exits are queued by hand."""

    def __init__(self, hosts, limits=None, cooldown=None):
        self.hosts = HostManager(cooldown)
        self.hosts.update(hosts, 0.0)
        self.limits = limits or Limits(np=2, min_np=1)
        self.job = Job()
        self.workers = {}
        self.joined = None
        self.stop_signal = None
        self.exits = []
        self.reports = 0
        self.drained = frozenset()     # elasticctl drain
        self.errors = {}        # worker id -> the error text of its failure report
        self.replaced_failed = ()    # replaced rounds whose failure doorbell rang

    def facts(self, liveness=False):
        # Every member of the current round joined it unless a test says otherwise.
        joined = len(self.job.members) if self.joined is None else self.joined
        return Facts(job=self.job, limits=self.limits, hosts=self.hosts,
                     workers=dict(self.workers), exits=tuple(self.exits),
                     liveness_checked=liveness, failure_reports=self.reports,
                     failure_errors=dict(self.errors),
                     joined=joined, stop_signal=self.stop_signal, drained=self.drained,
                     replaced_failed=self.replaced_failed)

    def tick(self, now, liveness=False):
        actions = decide(self.facts(liveness), now)
        self.exits = []
        for a in actions:
            self.job = evolve(self.job, a)
            if isinstance(a, Spawn):
                self.workers[a.worker_id] = WorkerView(a.worker_id, a.host, a.slot, started=now,
                                                       heartbeat_at=now)
            elif isinstance(a, Stop) and a.worker_id in self.workers:
                self.workers[a.worker_id] = dataclasses.replace(self.workers[a.worker_id],
                                                                stopped=True)
            elif isinstance(a, HostFailed):
                self.hosts.blacklist(a.host, now)
        return actions

    def ready(self, *ids, beats=1, at=0.0):
        for wid in ids or list(self.workers):
            self.workers[wid] = dataclasses.replace(self.workers[wid], ready=True, beats=beats,
                                                    heartbeat_at=at)

    def exit(self, wid, code, done_round=None):
        w = self.workers.pop(wid)
        self.exits.append(Exit(wid, w.host, code, stopped=w.stopped, ready=w.ready,
                               done_round=done_round))

    def running(self, now=1.0):
        """Spawn, make ready and publish round 1 with every slot."""
        self.tick(0.0)
        self.ready()
        actions = self.tick(now)
        assert [type(a) for a in actions] == [Publish]
        return actions[0]


def kinds(actions):
    return [type(a).__name__ for a in actions]
