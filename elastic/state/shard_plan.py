"""Where the rows of a sharded state live, and which rows move when the world changes.

FSDP2 (``fully_shard``) splits every parameter, and the optimizer state shaped
like it, along dim 0 as ``torch.chunk`` does: with ``n`` ranks, shard ``i`` holds
rows ``[i*c, (i+1)*c)`` clipped to the tensor, where ``c = ceil(rows / n)``. So
the rows each rank owns follow from the world size alone, and a new world size
gives a new owner for some rows. The plan here names, for every row range a new
rank needs, one surviving holder of it, and keeps a rank's own rows local: only
the rows whose owner changes travel.

Pure functions, the same on every rank given the same allgathered holdings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from elastic.exceptions import ElasticError

# What a sharded commit holds, per tensor in a fixed order: (key, full shape, dtype name).
Meta = list[tuple[str, tuple[int, ...], str]]
# Per tensor key: (dtype name, offset in that dtype's flat, first row, row past the last).
Layout = dict[str, tuple[str, int, int, int]]


class ShardsLost(ElasticError):
    """No survivor holds some shard of the newest commit (more losses than the redundancy)."""

    def __init__(self, line: str, version: int = -1, missing: Iterable[int] = ()) -> None:
        super().__init__(line)
        self.version = version          # the commit whose shards are lost
        self.missing = list(missing)    # their indices


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of tensor ``key``, from old shard ``shard`` held by ``src``,
    for new rank ``dst``."""

    src: int
    dst: int
    key: str
    shard: int
    start: int
    stop: int


def rows(total: int, n: int, i: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` shard ``i`` of ``n`` holds of a tensor of ``total`` rows."""
    c = -(-total // n) if total else 0
    return min(total, i * c), min(total, (i + 1) * c)


def row_numel(shape: Sequence[int]) -> int:
    """Elements per row (dim 0) of a tensor of ``shape``."""
    n = 1
    for s in shape[1:]:
        n *= s
    return n


def shard_layout(meta: Meta, n: int, i: int) -> tuple[Layout, dict[str, int]]:
    """Per key of ``meta`` [(key, shape, dtype name)]: (dtype, offset, start, stop) of
    shard ``i`` of ``n`` in its dtype's flat buffer; and the flats' sizes {dtype: numel}."""
    layout: Layout = {}
    sizes: dict[str, int] = {}
    for key, shape, dtype in meta:
        start, stop = rows(shape[0], n, i)
        offset = sizes.get(dtype, 0)
        layout[key] = (dtype, offset, start, stop)
        sizes[dtype] = offset + (stop - start) * row_numel(shape)
    return layout, sizes


def copies_kept(rank: int, n: int, degree: int) -> list[int]:
    """The other shards ``rank`` keeps a copy of: its ``degree`` predecessors (ring)."""
    return [(rank - d) % n for d in range(1, min(degree, n - 1) + 1)]


def copy_targets(rank: int, n: int, degree: int) -> list[int]:
    """The ranks that keep a copy of ``rank``'s shard: its ``degree`` successors."""
    return [(rank + d) % n for d in range(1, min(degree, n - 1) + 1)]


def hand_off(held: Sequence[tuple[bool, Iterable[int]]]) -> list[tuple[int, int, int]]:
    """The shards that leaving ranks must hand to staying ones before they go, given per
    rank (leaving?, [shard indices held]): [(shard, src, dst)]. Each shard no stayer
    holds goes from its lowest holder to the stayer given the fewest so far (ties: lowest
    rank). Nothing when nobody leaves or nobody stays."""
    stayers = [r for r, (leaving, _s) in enumerate(held) if not leaving]
    if len(stayers) == len(held) or not stayers:
        return []
    holders: dict[int, list[int]] = {}
    for r, (_leaving, shards) in enumerate(held):
        for i in shards:
            holders.setdefault(i, []).append(r)
    given = {r: 0 for r in stayers}
    moves = []
    for i in sorted(holders):
        if any(r in given for r in holders[i]):
            continue
        dst = min(stayers, key=lambda r: (given[r], r))
        given[dst] += 1
        moves.append((i, min(holders[i]), dst))
    return moves


def choose_version(holdings: Iterable[Iterable[tuple[int, int, Iterable[int]]]],
                   ) -> tuple[int, int] | None:
    """The commit to resume from, given per new rank [(version, n, shards held)]:
    (version, n) of the newest commit whose shards are all held by someone.

    A rank keeps at most two commits (the last one, and the one being committed
    when a peer failed: complete on every rank that reached the commit's closing
    collective), so this is the last commit or the one before. When no commit is
    whole, its lost shards exist nowhere: raise ShardsLost rather than train on
    without them. None when nobody holds anything (a fresh job).
    """
    covered: dict[tuple[int, int], set[int]] = {}
    for held in holdings:
        for version, n, shards in held:
            covered.setdefault((version, n), set()).update(shards)
    if not covered:
        return None
    complete = [(v, n) for (v, n), s in covered.items() if s >= set(range(n))]
    if not complete:
        (version, n), have = max(covered.items())
        lost = sorted(set(range(n)) - have)
        raise ShardsLost(f"commit {version}: no surviving worker holds shard(s) {lost} of {n}; "
                         "more workers were lost than the redundancy covers", version, lost)
    return max(complete)


def plan(meta: Meta, old_n: int, holders: Mapping[int, Sequence[int]], new_n: int) -> list[Piece]:
    """The pieces that make up every new rank's shard of ``meta``.

    ``holders``: {old shard index: [new ranks holding it]}. A piece a rank holds
    itself comes from itself (a local copy); otherwise from the holder that has
    been given the fewest bytes to send so far (ties: lowest rank), so a shard
    held twice is read from both.
    """
    missing = [i for i in range(old_n) if not holders.get(i)]
    if missing:
        raise ShardsLost(f"no surviving worker holds shard(s) {missing}")
    load: dict[int, int] = {}
    pieces = []
    for dst in range(new_n):
        for key, shape, _dtype in meta:
            start, stop = rows(shape[0], new_n, dst)
            for i in range(old_n):
                a, b = rows(shape[0], old_n, i)
                lo, hi = max(a, start), min(b, stop)
                if lo >= hi:
                    continue
                if dst in holders[i]:
                    src = dst
                else:
                    src = min(holders[i], key=lambda r: (load.get(r, 0), r))
                    load[src] = load.get(src, 0) + (hi - lo) * row_numel(shape)
                pieces.append(Piece(src, dst, key, i, lo, hi))
    return pieces
