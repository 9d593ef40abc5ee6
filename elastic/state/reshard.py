"""Moving shards between ranks: redundancy copies at a commit, and a reshard after a change.

Both run point-to-point on the round's gloo group, on a helper thread the caller
waits on in abort-watching slices (``run_blocking``), as elastic.state.transfer
does. A shard is one flat buffer per dtype (``shard_plan.shard_layout``); between
two ranks a reshard sends one message per dtype holding every piece the plan
routes between them, in plan order, so both sides know the cut without a header.
"""

from __future__ import annotations

import torch

from elastic.state import shard_plan
from elastic.state.snapshot import host_empty

COPY_TAG = 1 << 16      # redundancy copies; reshard messages use small tags (dtype index)


def _dtype(name):
    return getattr(torch, name.replace("torch.", ""))


def empty_shard(meta, n, i):
    """New flat buffers {dtype: flat} for shard ``i`` of ``n`` of ``meta``."""
    _layout, sizes = shard_plan.shard_layout(meta, n, i)
    return {d: host_empty(numel, _dtype(d)) for d, numel in sizes.items()}


def shard_views(meta, n, i, flats):
    """{key: view of shard ``i``'s rows of ``key`` inside ``flats``}."""
    layout, _sizes = shard_plan.shard_layout(meta, n, i)
    shapes = {key: shape for key, shape, _d in meta}
    out = {}
    for key, (d, offset, start, stop) in layout.items():
        shape = (stop - start,) + tuple(shapes[key][1:])
        numel = (stop - start) * shard_plan.row_numel(shapes[key])
        out[key] = flats[d][offset: offset + numel].view(shape)
    return out


def exchange_copies(group, me, n, degree, meta, own):
    """Send ``own`` (this rank's shard flats) to its copy holders, and receive the
    shards it keeps a copy of. Returns {shard index: flats}; bytes sent."""
    dtypes = sorted(own)
    works, sent = [], 0
    for dst in shard_plan.copy_targets(me, n, degree):
        for t, d in enumerate(dtypes):
            if own[d].numel():
                works.append(group.send([own[d]], dst, COPY_TAG + t))
                sent += own[d].numel() * own[d].element_size()
    kept = {}
    for src in shard_plan.copies_kept(me, n, degree):
        flats = empty_shard(meta, n, src)
        for t, d in enumerate(sorted(flats)):
            if flats[d].numel():
                works.append(group.recv([flats[d]], src, COPY_TAG + t))
        kept[src] = flats
    for work in works:
        work.wait()
    return kept, sent


def reshard(group, me, pieces, meta, old_n, new_n, held):
    """This rank's new shard, as {key: fresh tensor}, from ``pieces`` (shard_plan.plan).

    ``held``: {old shard index: {key: view}} this rank holds (own and copies). Rows
    it holds are copied locally; the rest arrive one message per (peer, dtype).
    Returns (tensors, bytes received, bytes sent).
    """
    shapes = {key: (tuple(shape), d) for key, shape, d in meta}
    dtypes = sorted({d for _k, _s, d in meta})
    out = {}
    for key, (shape, d) in shapes.items():
        start, stop = shard_plan.rows(shape[0], new_n, me)
        out[key] = torch.empty((stop - start,) + shape[1:], dtype=_dtype(d))

    def into(p):
        start, _stop = shard_plan.rows(shapes[p.key][0][0], new_n, p.dst)
        return out[p.key][p.start - start: p.stop - start]

    def source(p):
        start, _stop = shard_plan.rows(shapes[p.key][0][0], old_n, p.shard)
        return held[p.shard][p.key][p.start - start: p.stop - start]

    outgoing, incoming = {}, {}
    for p in pieces:
        if p.src == me and p.dst == me:
            into(p).copy_(source(p))
        elif p.src == me:
            outgoing.setdefault(p.dst, []).append(p)
        elif p.dst == me:
            incoming.setdefault(p.src, []).append(p)
    works, sent, received, landing = [], 0, 0, []
    for dst, ps in sorted(outgoing.items()):
        for t, d in enumerate(dtypes):
            parts = [source(p).reshape(-1) for p in ps if shapes[p.key][1] == d]
            if parts:
                body = torch.cat(parts)
                works.append(group.send([body], dst, t))
                sent += body.numel() * body.element_size()
    for src, ps in sorted(incoming.items()):
        for t, d in enumerate(dtypes):
            mine = [p for p in ps if shapes[p.key][1] == d]
            if mine:
                body = torch.empty(sum(into(p).numel() for p in mine), dtype=_dtype(d))
                works.append(group.recv([body], src, t))
                landing.append((body, mine))
                received += body.numel() * body.element_size()
    for work in works:
        work.wait()
    for body, mine in landing:
        offset = 0
        for p in mine:
            target = into(p)
            target.copy_(body[offset: offset + target.numel()].view(target.shape))
            offset += target.numel()
    return out, received, sent

