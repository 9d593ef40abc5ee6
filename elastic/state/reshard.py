"""Moving shards between ranks: redundancy copies at a commit, and a reshard after a change.

Both run point-to-point on the round's gloo group, on a helper thread the caller
waits on in abort-watching slices (``run_blocking``), as elastic.state.transfer
does. A shard is one flat buffer per dtype (``shard_plan.shard_layout``); a reshard
sends each piece the plan routes between two ranks as one message, tagged by its
place in the plan's order between them, so both sides match them without a header.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from elastic.state import shard_plan
from elastic.state.snapshot import host_empty

if TYPE_CHECKING:
    from elastic.state.shard_plan import Meta, Piece
    from elastic.state.transfer import PointToPoint

COPY_TAG = 1 << 16      # redundancy copies; reshard messages use small tags (piece index)
HAND_OFF_TAG = 1 << 17  # shards a leaving rank hands off: + 16 * shard + dtype index


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def empty_shard(meta: Meta, n: int, i: int) -> dict[str, torch.Tensor]:
    """New flat buffers {dtype: flat} for shard ``i`` of ``n`` of ``meta``."""
    _layout, sizes = shard_plan.shard_layout(meta, n, i)
    return {d: host_empty(numel, _dtype(d)) for d, numel in sizes.items()}


def shard_views(meta: Meta, n: int, i: int,
                flats: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{key: view of shard ``i``'s rows of ``key`` inside ``flats``}."""
    layout, _sizes = shard_plan.shard_layout(meta, n, i)
    shapes = {key: shape for key, shape, _d in meta}
    out = {}
    for key, (d, offset, start, stop) in layout.items():
        shape = (stop - start,) + tuple(shapes[key][1:])
        numel = (stop - start) * shard_plan.row_numel(shapes[key])
        out[key] = flats[d][offset: offset + numel].view(shape)
    return out


def exchange_copies(group: PointToPoint, me: int, n: int, degree: int, meta: Meta,
                    own: dict[str, torch.Tensor]) -> tuple[dict[int, dict[str, torch.Tensor]], int]:
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


def hand_off(group: PointToPoint, me: int, moves: Iterable[tuple[int, int, int]], meta: Meta,
             n: int, shards: Mapping[int, Mapping[str, torch.Tensor]],
             ) -> tuple[dict[int, dict[str, torch.Tensor]], int]:
    """Carry out shard_plan.hand_off's ``moves`` [(shard, src, dst)] of a commit of ``n``
    shards; ``shards`` {index: flats} this rank holds. Returns {index: flats} received
    and bytes sent."""
    works: list = []
    got: dict[int, dict[str, torch.Tensor]] = {}
    sent = 0
    for i, src, dst in moves:
        if src == me:
            for t, d in enumerate(sorted(shards[i])):
                if shards[i][d].numel():
                    works.append(group.send([shards[i][d]], dst, HAND_OFF_TAG + 16 * i + t))
                    sent += shards[i][d].numel() * shards[i][d].element_size()
        elif dst == me:
            got[i] = empty_shard(meta, n, i)
            for t, d in enumerate(sorted(got[i])):
                if got[i][d].numel():
                    works.append(group.recv([got[i][d]], src, HAND_OFF_TAG + 16 * i + t))
    for work in works:
        work.wait()
    return got, sent


def reshard(group: PointToPoint | None, me: int, pieces: Iterable[Piece], meta: Meta, old_n: int,
            new_n: int, held: Mapping[int, Mapping[str, torch.Tensor]],
            dest: Mapping[str, torch.Tensor] | None = None,
            ) -> tuple[dict[str, torch.Tensor], int, int]:
    """This rank's new shard, as {key: tensor}, from ``pieces`` (shard_plan.plan).

    ``held``: {old shard index: {key: view}} this rank holds (own and copies). Rows
    it holds are copied locally; each other piece is one message, sent straight from
    the held buffer and received straight into its rows of the new shard (no packing,
    no landing buffer). ``dest``: {key: tensor of the new shard's shape} to fill in
    place (a rebuilt model's local parameters, memory already touched); other keys get
    fresh tensors. Returns (tensors, bytes received, bytes sent).
    """
    shapes = {key: (tuple(shape), d) for key, shape, d in meta}
    out: dict[str, torch.Tensor] = {}
    for key, (shape, d) in shapes.items():
        start, stop = shard_plan.rows(shape[0], new_n, me)
        want = (stop - start,) + shape[1:]
        given = (dest or {}).get(key)
        if given is not None and tuple(given.shape) == want and given.is_contiguous():
            out[key] = given
        else:
            out[key] = torch.empty(want, dtype=_dtype(d))

    def into(p: Piece) -> torch.Tensor:
        start, _stop = shard_plan.rows(shapes[p.key][0][0], new_n, p.dst)
        return out[p.key][p.start - start: p.stop - start]

    def source(p: Piece) -> torch.Tensor:
        start, _stop = shard_plan.rows(shapes[p.key][0][0], old_n, p.shard)
        return held[p.shard][p.key][p.start - start: p.stop - start]

    works, sent, received = [], 0, 0
    count: dict[tuple[int, int], int] = {}
    for p in pieces:
        if p.src == me and p.dst == me:
            into(p).copy_(source(p))
        elif me in (p.src, p.dst):
            assert group is not None, "only a piece kept on its rank needs no group"
            tag = count.get((p.src, p.dst), 0)      # the plan's order, alike on both sides
            count[(p.src, p.dst)] = tag + 1
            if p.src == me:
                body = source(p)
                works.append(group.send([body], p.dst, tag))
                sent += body.numel() * body.element_size()
            else:
                body = into(p)
                works.append(group.recv([body], p.src, tag))
                received += body.numel() * body.element_size()
    for work in works:
        work.wait()
    return out, received, sent
