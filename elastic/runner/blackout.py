"""When every heartbeat stops at once, the driver's own network is the likely cause.

Workers on different hosts do not all fall silent in the same second unless what
they share fails: the driver's link. Evicting them then would blacklist every host
and end the job ("every host is blacklisted") when the network returns a minute
later. So while every watched worker (on two or more hosts) has been silent since
about the same moment, nobody is evicted for silence, for at most
``NETWORK_WAIT_S`` after the last beat. Workers keep retrying the store as long
(elastic/store_link.py, RECONNECT_WITHIN_S), so they are still there when the
network comes back. Once beats return, a worker that is still silent gets a full
``--worker-timeout`` from that moment. Past the bound, silence is handled as usual.
Pure functions; policy.check_liveness asks ``hold_silence`` (docs/failure-model.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from elastic.runner.decisions import Action, Job, NetworkQuiet, WorkerView

NETWORK_WAIT_S = 90.0     # the longest the driver waits for its network before evicting


def at_once_s(worker_timeout: float) -> float:
    """Beats that stopped within this many seconds of each other stopped at once (beats
    come every second, or every tenth of a shorter --worker-timeout; the driver reads
    them every half second). Always under a third of the timeout: a wider window would
    call live workers' last beats, always that close, a blackout at any silence, and
    hold every eviction (a SIGSTOPped worker under --worker-timeout 1.5 was never evicted)."""
    return min(max(2.0, min(10.0, worker_timeout / 3)), worker_timeout / 3)


def watched(workers: Iterable[WorkerView]) -> list[WorkerView]:
    return [w for w in workers
            if not w.stopped and (w.beats or w.ready) and w.leaving_since is None]


def every_beat_stopped(workers: Iterable[WorkerView], now: float, worker_timeout: float,
                       ended: float = 0.0) -> float | None:
    """When every watched worker fell silent, if they did so at once, on two or more
    hosts, and long enough ago that the first of them is about to be evicted; else None."""
    ws = watched(workers)
    if len(ws) < 2 or len({w.host for w in ws}) < 2:
        return None
    last = [max(w.heartbeat_at, ended) for w in ws]
    window = at_once_s(worker_timeout)
    if max(last) - min(last) > window or now - max(last) <= worker_timeout - window:
        return None
    return max(last)


def hold_silence(job: Job, workers: Mapping[str, WorkerView], now: float, worker_timeout: float,
                 emit: Callable[[Action], None]) -> bool:
    """Whether evictions for missing heartbeats wait this tick; emits NetworkQuiet
    when an episode begins or ends (one warning each)."""
    since = every_beat_stopped(workers.values(), now, worker_timeout, job.quiet_ended)
    if since is not None and now - since < NETWORK_WAIT_S:
        if job.quiet_since is None:
            ws = watched(workers.values())
            emit(NetworkQuiet("", (
                f"every heartbeat stopped at once ({len(ws)} workers on "
                f"{len({w.host for w in ws})} hosts): elasticrun's own network looks down; "
                f"evicting nobody for it while waiting up to {NETWORK_WAIT_S:.0f} s"), since,
                             job.quiet_ended))
        return True
    if job.quiet_since is not None:
        if since is None:
            emit(NetworkQuiet("", f"heartbeats are back after {now - job.quiet_since:.0f} s; "
                                  "the network is back", None, now))
        else:
            emit(NetworkQuiet("", (
                f"no heartbeat from any worker for {now - since:.0f} s: the network did not "
                "come back; silent workers are evicted"), None, job.quiet_ended))
    return False


def silent_for(worker: WorkerView, job: Job, now: float) -> float:
    """How long ``worker`` has been silent, counting from the end of a network outage."""
    return now - max(worker.heartbeat_at, job.quiet_ended)
