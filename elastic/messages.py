"""The round's values in the control store, typed: a member's place (``Keys.member``),
the round's header (``Keys.plan``) and the driver's word on its assembly
(``Keys.assembled``). Both sides use these classes; their JSON is the wire format
and does not change. Part of the contract: elastic/protocol.py names them.

``from_json`` checks every field and raises one MessageError, so a malformed value
is one clear line, never a KeyError deep in the worker.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union

from elastic.exceptions import ElasticError

MEMBERSHIP_FIELDS = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")

EncodedIds = list  # encode_ids' output: [first, count] runs of decimal ids, then other ids


def encode_ids(ids: Iterable[str]) -> EncodedIds:
    """Worker ids as a short list: decimal ids as sorted [first, count] runs of
    consecutive ids (a job's members are mostly consecutive), any other id as
    itself."""
    runs: list[str] = []
    names: list[str] = []
    for wid in ids:
        (runs if str(wid).isdecimal() else names).append(str(wid))
    out: list = []
    for n in sorted({int(i) for i in runs}):
        if out and out[-1][0] + out[-1][1] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return out + sorted(set(names))


def ids_contain(encoded: EncodedIds, worker_id: str | int) -> bool:
    """Whether the list of encode_ids holds ``worker_id``."""
    wid = str(worker_id)
    if not wid.isdecimal():
        return wid in encoded
    n = int(wid)
    runs = [r for r in encoded if isinstance(r, list)]
    i = bisect.bisect_right([r[0] for r in runs], n) - 1
    return i >= 0 and n < runs[i][0] + runs[i][1]


def decode_ids(encoded: EncodedIds) -> list[str]:
    return [str(r[0] + k) if isinstance(r, list) else r
            for r in encoded for k in (range(r[1]) if isinstance(r, list) else (0,))]


# -- the round's values in the store, typed (the JSON is the wire format) ---------------------
class MessageError(ElasticError):
    """A control-plane value without the contract's shape. Sealed values come only from
    the driver, so this is a bug or two versions of elastic in one job, never forgery."""


JsonValue = Union[dict, list, str, int, float, bool, None]


def _fields(value: object, what: str, **kinds: type) -> dict[str, Any]:
    """``value``'s fields named in ``kinds``, each checked to be of its kind (ints are
    never bools and never negative)."""
    if not isinstance(value, Mapping):
        raise MessageError(f"{what}: expected a JSON object, got {type(value).__name__}")
    out = {}
    for name, kind in kinds.items():
        field = value.get(name)
        negative = isinstance(field, int) and field < 0
        if not isinstance(field, kind) or (kind is int and (isinstance(field, bool) or negative)):
            raise MessageError(f"{what}: {name!r} is {field!r}, not a {kind.__name__}"
                               + (" >= 0" if kind is int else ""))
        out[name] = field
    return out


@dataclass(frozen=True)
class Member:
    """One member of a round (``Keys.member``, and the driver's plan): its place. Ranks
    follow runner/planner.py; every member carries the round's size."""

    worker_id: str
    host: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def to_json(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "host": self.host, "rank": self.rank,
                "size": self.size, "local_rank": self.local_rank, "local_size": self.local_size,
                "cross_rank": self.cross_rank, "cross_size": self.cross_size}

    @classmethod
    def from_json(cls, value: JsonValue) -> Member:
        """The member ``value`` describes; MessageError if a field is missing, of the wrong
        kind, or a rank is outside its size."""
        f = _fields(value, "round member", worker_id=str, host=str,
                    **dict.fromkeys(MEMBERSHIP_FIELDS, int))
        for rank, size in (("rank", "size"), ("local_rank", "local_size"),
                           ("cross_rank", "cross_size")):
            if f[rank] >= f[size]:
                raise MessageError(f"round member: {rank} {f[rank]} is not below {size} {f[size]}")
        return cls(**f)


@dataclass(frozen=True)
class RoundPlan:
    """A round's header (``Keys.plan``): its size and its members' ids as runs
    (encode_ids), so a worker learns whether it is a member in O(runs) bytes."""

    round_id: int
    size: int
    ids: tuple         # encode_ids' entries: (first, count) pairs, then other ids

    @classmethod
    def of(cls, round_id: int, worker_ids: Iterable[str]) -> RoundPlan:
        ids = tuple(tuple(r) if isinstance(r, list) else r for r in encode_ids(worker_ids))
        return cls(round_id, sum(r[1] if isinstance(r, tuple) else 1 for r in ids), ids)

    def encoded(self) -> EncodedIds:
        return [list(r) if isinstance(r, tuple) else r for r in self.ids]

    def contains(self, worker_id: str) -> bool:
        return ids_contain(self.encoded(), worker_id)

    def member_ids(self) -> list[str]:
        return decode_ids(self.encoded())

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round_id, "size": self.size, "ids": self.encoded()}

    @classmethod
    def from_json(cls, value: JsonValue) -> RoundPlan:
        f = _fields(value, "round plan", round=int, size=int, ids=list)
        ids: list = []
        for r in f["ids"]:
            if isinstance(r, list) and len(r) == 2 and all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in r):
                ids.append(tuple(r))
            elif isinstance(r, str):
                ids.append(r)
            else:
                raise MessageError(f"round plan: id entry {r!r} is neither [first, count] nor a name")
        return cls(f["round"], f["size"], tuple(ids))


@dataclass(frozen=True)
class Assembled:
    """The driver's word on a round's assembly (``Keys.assembled``): ok once every
    member arrived, not ok if it was aborted or replaced first."""

    round_id: int
    ok: bool

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round_id, "ok": self.ok}

    @classmethod
    def from_json(cls, value: JsonValue) -> Assembled:
        f = _fields(value, "round assembly", round=int, ok=bool)
        return cls(f["round"], f["ok"])
