"""The driver's decision cost at scale: synthetic facts, no processes (issue 14 part 3).

The driver ticks every 50 ms; on most ticks nothing happened, and every 0.5 s
it reads heartbeats and ``policy.decide`` looks at every worker. This measures,
for N workers (one slot per host, and 8 slots per host), the median wall time of:

  quiet     ``policy.can_skip`` on a tick where nothing happened
  tick      ``decide`` on that quiet tick (what it costs when not skipped; before can_skip, always)
  liveness  ``decide`` on a heartbeat tick of a healthy running job
  crash     ``decide`` on a tick with one worker's non-zero exit (re-plans)
  spawn     ``decide`` on a tick where discovery added one host (spawns its workers)
  admit     ``decide`` on a tick where the newcomer is ready (publishes the grown round)
  plan      ``planner.plan_round`` alone over the N ready workers

``measure()`` returns {(N, slots_per_host): {row: seconds}} (``make scale`` prints it);
``python benchmarks/decide_bench.py`` prints a table. Runs in well under a minute.
"""

import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elastic.runner import policy  # noqa: E402
from elastic.runner.decisions import Exit, Facts, Job, Limits, Publish, WorkerView, evolve  # noqa: E402
from elastic.runner.hosts import HostManager  # noqa: E402
from elastic.runner.planner import Candidate, plan_round  # noqa: E402
from elastic.runner.stalls import Liveness  # noqa: E402

SIZES = (256, 1024, 4096)
SLOTS = (1, 8)
ROWS = ("quiet", "tick", "liveness", "crash", "spawn", "admit", "plan")
NOW = 1000.0


def _hosts(n, slots):
    return {f"node-{i:05d}": slots for i in range(n // slots)}


def _running(n, slots):
    """A job training in round 1 with every slot, all heartbeats fresh, half in an allreduce."""
    discovered = _hosts(n, slots)
    hosts = HostManager((10.0, 100.0))
    hosts.update(discovered, 0.0)
    workers = {}
    for wid, (host, slot) in enumerate((h, s) for h, k in discovered.items() for s in range(k)):
        waiting = {"what": "allreduce", "round": 1, "seconds": 0.01} if wid % 2 else None
        live = Liveness(beat=5, beat_at=NOW - 0.2, progress=(40, 4), progress_at=NOW - 0.3,
                        waiting=waiting)
        workers[str(wid)] = WorkerView(str(wid), host, slot, started=1.0, ready=True, beats=5,
                                       heartbeat_at=NOW - 0.2, liveness=live)
    members = plan_round([Candidate(w.worker_id, w.host, w.slot) for w in workers.values()], [])
    job = evolve(Job(next_worker=n), Publish(1, tuple(members), "start"))
    return job, hosts, workers


def _facts(job, hosts, workers, limits, **kw):
    return Facts(job=job, limits=limits, hosts=hosts, workers=workers,
                 joined=len(job.members), **kw)


def _median(fn, budget_s=0.25, most=25):
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (len(times) < most and time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _quiet(job, limits):
    if not hasattr(policy, "can_skip"):
        return None                      # before issue 14: every tick ran decide
    return lambda: policy.can_skip(job, limits, NOW, settled_at=NOW - 0.05, exits=(),
                                   liveness_checked=False, failure_reports=0, newly_ready=0,
                                   unready=0, last_spawn_at=1.0, hosts_changed=False,
                                   stop_signal=None)


def measure_one(n, slots, budget_s=0.25):
    limits = Limits(np=n, min_np=1, max_np=None)
    job, hosts, workers = _running(n, slots)
    out = {}
    quiet = _quiet(job, limits)
    out["quiet"] = _median(quiet, budget_s) if quiet else None

    quiet_facts = _facts(job, hosts, workers, limits)
    assert policy.decide(quiet_facts, NOW) == []
    out["tick"] = _median(lambda: policy.decide(quiet_facts, NOW), budget_s)

    facts = _facts(job, hosts, workers, limits, liveness_checked=True)
    assert policy.decide(facts, NOW) == [], "a healthy job must decide nothing"
    out["liveness"] = _median(lambda: policy.decide(facts, NOW), budget_s)

    victim = workers[str(n // 2)]
    alive = {w: v for w, v in workers.items() if w != victim.worker_id}
    crash = _facts(job, hosts, alive, limits, exits=(Exit(victim.worker_id, victim.host, 1,
                                                           ready=True),))
    assert type(policy.decide(crash, NOW)[-1]).__name__ == "Publish"
    out["crash"] = _median(lambda: policy.decide(crash, NOW), budget_s)

    grown = HostManager((10.0, 100.0))
    grown.update({**_hosts(n, slots), "node-new": slots}, 0.0)
    spawn = _facts(job, grown, workers, limits)
    spawned = policy.decide(spawn, NOW)
    assert [type(a).__name__ for a in spawned] == ["Spawn"] * slots
    out["spawn"] = _median(lambda: policy.decide(spawn, NOW), budget_s)

    newcomers = {a.worker_id: WorkerView(a.worker_id, a.host, a.slot, started=NOW - 5,
                                         ready=True, beats=1, heartbeat_at=NOW)
                 for a in spawned}
    job_after = job
    for a in spawned:
        job_after = evolve(job_after, a)
    admit = _facts(job_after, grown, {**workers, **newcomers}, limits)
    assert type(policy.decide(admit, NOW)[-1]).__name__ == "Publish"
    out["admit"] = _median(lambda: policy.decide(admit, NOW), budget_s)

    candidates = [Candidate(w.worker_id, w.host, w.slot) for w in workers.values()]
    order = list(job.host_order)
    out["plan"] = _median(lambda: plan_round(candidates, order), budget_s)
    return out


def measure(sizes=SIZES, slots=SLOTS, budget_s=0.25):
    """{(N, slots per host): {row: median seconds or None}}."""
    return {(n, s): measure_one(n, s, budget_s) for n in sizes for s in slots}


def _ms(v):
    return "n/a" if v is None else f"{v * 1e3:.3f}"


def main():
    results = measure()
    print("| N | slots/host | " + " | ".join(f"{r} (ms)" for r in ROWS) + " |")
    print("|---|---|" + "---|" * len(ROWS))
    for (n, s), row in results.items():
        print(f"| {n} | {s} | " + " | ".join(_ms(row[r]) for r in ROWS) + " |")


if __name__ == "__main__":
    main()
