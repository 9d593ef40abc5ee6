"""Round planning: who is in the next round, and with which ranks. Pure functions.

Rank stability: hosts keep the order in which they first joined the job, so
survivors keep their relative order, new hosts go last, and rank 0 is slot 0
of the oldest surviving host.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    host: str
    slot: int


def order_hosts(host_order, hosts):
    """Extend ``host_order`` (oldest first) with hosts it has not seen, keeping theirs."""
    order = [h for h in host_order if h in hosts]
    order.extend(h for h in hosts if h not in order)
    return order


def plan_round(candidates, host_order, max_np=None):
    """Ordered member dicts for the next round.

    ``candidates`` are the ready workers the driver wants; ``host_order`` the
    hosts that have taken part so far, oldest first. Beyond ``max_np`` the
    newest hosts' highest slots are left out.
    """
    hosts = order_hosts(host_order, list(dict.fromkeys(c.host for c in candidates)))
    rank_of_host = {h: i for i, h in enumerate(hosts)}
    ordered = sorted(candidates, key=lambda c: (rank_of_host[c.host], c.slot))
    if max_np is not None:
        ordered = ordered[:max_np]
    return assign(ordered)


def assign(ordered):
    """Ranks, local ranks and cross ranks for an ordered list of candidates."""
    local_index = {}
    for c in ordered:
        local_index.setdefault(c.host, []).append(c.worker_id)
    host_seq = list(local_index)
    members = []
    for rank, c in enumerate(ordered):
        local_rank = local_index[c.host].index(c.worker_id)
        # Hosts that have a worker at this local rank form the cross group.
        peers = [h for h in host_seq if len(local_index[h]) > local_rank]
        members.append({
            "worker_id": c.worker_id, "host": c.host, "rank": rank, "size": len(ordered),
            "local_rank": local_rank, "local_size": len(local_index[c.host]),
            "cross_rank": peers.index(c.host), "cross_size": len(peers),
        })
    return members


def same_membership(previous, members):
    return [m["worker_id"] for m in previous] == [m["worker_id"] for m in members]


def describe_change(previous, members):
    """A short human summary such as '+2 on node-3, -1 on node-1'."""
    before = {m["worker_id"]: m["host"] for m in previous}
    after = {m["worker_id"]: m["host"] for m in members}
    parts = []
    for sign, ids, table in (("+", after.keys() - before.keys(), after),
                             ("-", before.keys() - after.keys(), before)):
        per_host = {}
        for wid in ids:
            per_host[table[wid]] = per_host.get(table[wid], 0) + 1
        parts.extend(f"{sign}{n} on {h}" for h, n in sorted(per_host.items()))
    return ", ".join(parts)
