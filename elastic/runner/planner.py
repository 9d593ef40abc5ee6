"""Round planning: who is in the next round, and with which ranks. Pure functions.

Rank stability: hosts keep the order in which they first joined the job, so
survivors keep their relative order, new hosts go last, and rank 0 is slot 0
of the oldest surviving host.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from elastic.messages import Member  # not elastic.protocol: the pure core needs no torch


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    host: str
    slot: int


class Seat(Protocol):
    """What the planner reads of a candidate: Candidate, decisions.WorkerView, ..."""

    @property
    def worker_id(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def slot(self) -> int: ...


def order_hosts(host_order: Iterable[str], hosts: Iterable[str]) -> list[str]:
    """Extend ``host_order`` (oldest first) with hosts it has not seen, keeping theirs.

    Linear: set lookups, not list scans (the planner runs on every tick at thousands of hosts).
    """
    present = set(hosts)
    order = [h for h in host_order if h in present]
    seen = set(order)
    for h in hosts:
        if h not in seen:
            seen.add(h)
            order.append(h)
    return order


def plan_round(candidates: Iterable[Seat], host_order: Iterable[str],
               max_np: int | None = None) -> list[Member]:
    """The next round's members (protocol.Member), in rank order.

    ``candidates`` are the ready workers the driver wants (anything with
    ``worker_id``, ``host`` and ``slot``: Candidates, WorkerViews); ``host_order`` the
    hosts that have taken part so far, oldest first. Beyond ``max_np`` the
    newest hosts' highest slots are left out. O(n log n) in the candidates.
    """
    hosts = order_hosts(host_order, list(dict.fromkeys(c.host for c in candidates)))
    rank_of_host = {h: i for i, h in enumerate(hosts)}
    ordered = sorted(candidates, key=lambda c: (rank_of_host[c.host], c.slot))
    if max_np is not None:
        ordered = ordered[:max_np]
    return assign(ordered)


def assign(ordered: Sequence[Seat]) -> list[Member]:
    """Ranks, local ranks and cross ranks for an ordered list of candidates.

    A worker's local rank is its position among its host's workers; the hosts
    that have a worker at that local rank form its cross group, in the order
    the hosts first appear. One pass counts, one pass numbers: O(n).
    """
    local_size: dict[str, int] = {}                  # host -> its workers
    # (host, worker id) -> position on the host (first occurrence)
    local_rank_of: dict[tuple[str, str], int] = {}
    for c in ordered:
        k = local_size.get(c.host, 0)
        local_rank_of.setdefault((c.host, c.worker_id), k)
        local_size[c.host] = k + 1
    cross_size: list[int] = []                       # local rank -> hosts having it
    cross_rank_of: dict[tuple[str, int], int] = {}   # (host, local rank) -> its place there
    for host, k in local_size.items():
        for local_rank in range(k):
            if local_rank == len(cross_size):
                cross_size.append(0)
            cross_rank_of[host, local_rank] = cross_size[local_rank]
            cross_size[local_rank] += 1
    size = len(ordered)
    members: list[Member] = []
    append = members.append
    for rank, c in enumerate(ordered):
        host, wid = c.host, c.worker_id
        local_rank = local_rank_of[host, wid]
        append(Member(worker_id=wid, host=host, rank=rank, size=size,
                      local_rank=local_rank, local_size=local_size[host],
                      cross_rank=cross_rank_of[host, local_rank],
                      cross_size=cross_size[local_rank]))
    return members


def same_membership(previous: Iterable[Member], members: Iterable[Member]) -> bool:
    return [m.worker_id for m in previous] == [m.worker_id for m in members]


def describe_change(previous: Iterable[Member], members: Iterable[Member]) -> str:
    """A short human summary such as '+2 on node-3, -1 on node-1'."""
    before = {m.worker_id: m.host for m in previous}
    after = {m.worker_id: m.host for m in members}
    parts: list[str] = []
    for sign, ids, table in (("+", after.keys() - before.keys(), after),
                             ("-", before.keys() - after.keys(), before)):
        per_host: dict[str, int] = {}
        for wid in ids:
            per_host[table[wid]] = per_host.get(table[wid], 0) + 1
        parts.extend(f"{sign}{n} on {h}" for h, n in sorted(per_host.items()))
    return ", ".join(parts)
