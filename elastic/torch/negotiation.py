"""Agreeing on an op before it runs, as Horovod's coordinator does.

Every op first allgathers a small fixed-size int64 record from each rank of
its process set: what op, how many tensors, dtype, shape, root, reduction,
name, and a digest of the full signature. A disagreement (a shape, a dtype, a
root, a different op) is then raised on every rank as CollectiveMismatchError,
a RuntimeError the caller can catch; nothing crashes and nothing is retried.
Ranks inside ``join()`` send a JOIN record and take part in what the others do.
The exchange costs one small allgather per op (per group, for grouped ops).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from elastic.exceptions import ElasticError, WorkersDepartedError
from elastic.worker import collectives

if TYPE_CHECKING:
    from elastic.torch.process_sets import Binding

T = TypeVar("T")
Record = list[int]     # one rank's description of an op (the fields below)

ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, JOIN, BARRIER, WAIT = range(1, 9)
KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast",
              ALLTOALL: "alltoall", REDUCESCATTER: "reducescatter", JOIN: "join",
              BARRIER: "barrier", WAIT: "synchronize() of a named async op"}
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.complex64,
          torch.complex128]
OP_NAMES = {1: "Average", 2: "Sum", 3: "Min", 4: "Max", 5: "Product", 6: "Adasum"}
MAX_DIMS = 8
MAX_PENDING = 8     # named async ops a record lists as waiting for their peers (matching.py)
# record fields
KIND, COUNT, OP, ROOT, NAME, DIGEST, DTYPE, DEVICE, JOIN_STEP, NDIM, SHAPE = range(11)
MODE = SHAPE + MAX_DIMS      # matching.py: blocking, deferrable or waiting
KEY = MODE + 1               # hash of (op kind, name); 0 for an unnamed op
NPEND = KEY + 1              # how many pending named ops this rank has
PEND = NPEND + 1             # their keys, oldest first
LENGTH = PEND + MAX_PENDING


class CollectiveMismatchError(ElasticError):
    """Ranks asked for incompatible collectives (shapes, dtypes, roots, ops, names)."""


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)


def record(kind: int, tensors: Sequence[torch.Tensor] = (), op: int = 0, root: int = -1,
           name: str | None = None, vary_dim0: bool = False, join_step: int = 0) -> Record:
    """This rank's record (a list of ints); with ``vary_dim0`` dim 0 may differ across ranks."""
    rec = [-1] * LENGTH
    rec[KIND], rec[COUNT], rec[OP], rec[ROOT] = kind, len(tensors), op, root
    rec[NAME] = _hash(name) if name else 0
    rec[JOIN_STEP] = join_step
    signature = []
    for t in tensors:
        shape = list(t.shape)
        if vary_dim0 and shape:
            shape[0] = -1
        signature.append(f"{t.dtype}:{t.device.type}:{shape}")
    rec[DIGEST] = _hash("|".join(signature)) if len(tensors) > 1 else 0
    if tensors:
        first = tensors[0]
        rec[DTYPE] = dtype_code(first.dtype)
        rec[DEVICE] = 1 if first.is_cuda else 0
        rec[NDIM] = first.dim()
        rec[SHAPE:SHAPE + min(first.dim(), MAX_DIMS)] = list(first.shape)[:MAX_DIMS]
        if first.dim() > MAX_DIMS:
            rec[DIGEST] = _hash("|".join(signature))
    return rec


class Outcome:
    """What the records say: the records by set rank, who joined, and any mismatch."""

    def __init__(self, records: list[Record]) -> None:
        self.records = records
        self.joined = [r for r in range(len(records)) if records[r][KIND] == JOIN]
        self.active = [r for r in range(len(records)) if records[r][KIND] != JOIN]
        self.error: ElasticError | None = None

    @property
    def all_joined(self) -> bool:
        return not self.active

    @property
    def joinable(self) -> bool:
        """Only a plain allreduce goes on while some ranks are in join()."""
        first = self.records[self.active[0]]
        return int(first[KIND]) == ALLREDUCE and int(first[OP]) != ADASUM_CODE

    def dim0s(self) -> list[int]:
        return [int(r[SHAPE]) if int(r[NDIM]) > 0 else 1 for r in self.records]


def issue(fn: Callable[[], T], what: str) -> T:
    """Start backend work; a backend failure at this point means a peer is gone."""
    try:
        return fn()
    except WorkersDepartedError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise WorkersDepartedError(f"{what} failed: {exc}") from exc


# (round, set ranks) -> exchanges so far: the same count on every member
_exchanges: dict[tuple[int, tuple[int, ...]], int] = {}


def exchanges_so_far(binding: Binding) -> int:
    """How many records this set has exchanged in this round; orders the calls to join()."""
    return _exchanges.get((binding.worker.round_id, tuple(binding.ranks)), 0)


def exchange(binding: Binding, rec: Record) -> list[Record]:
    """Allgather ``rec`` over the set's CPU group; returns the records in set-rank order."""
    key = (binding.worker.round_id, tuple(binding.ranks))
    _exchanges[key] = _exchanges.get(key, 0) + 1
    mine = torch.tensor(rec, dtype=torch.int64)
    outputs = [torch.empty_like(mine) for _ in range(binding.size)]
    group = binding.cpu_group
    work = issue(lambda: group.allgather([outputs], [mine]), "negotiation")
    collectives.wait(work, "negotiation", binding.worker)
    return torch.stack(outputs).tolist()


ADASUM_CODE = 6     # reductions that joined ranks cannot take part in


def negotiate(binding: Binding, rec: Record, what: str, vary_dim0: bool = False) -> Outcome:
    """Exchange records and check them; the Outcome carries a mismatch error, if any."""
    return judge(Outcome(exchange(binding, rec)), binding, what, vary_dim0)


def judge(out: Outcome, binding: Binding, what: str, vary_dim0: bool = False) -> Outcome:
    """Set ``out.error`` when the exchanged records do not describe one op."""
    if out.all_joined:
        return out
    out.error = check_records(out, binding, what, vary_dim0)
    if out.error is None and out.joined and not out.joinable:
        out.error = CollectiveMismatchError(
            f"{what}: ranks {[binding.global_rank(r) for r in out.joined]} have called join(); "
            "only allreduce continues after a rank joins")
    return out


def check_records(out: Outcome, binding: Binding, what: str,
                  vary_dim0: bool) -> CollectiveMismatchError | None:
    recs = {binding.global_rank(r): out.records[r] for r in out.active}

    def differs(field, label, show=lambda v: v):
        values = {rank: int(rec[field]) for rank, rec in recs.items()}
        if len(set(values.values())) > 1:
            detail = ", ".join(f"rank {rank}: {show(v)}" for rank, v in sorted(values.items()))
            return CollectiveMismatchError(f"{what}: {label} differ across ranks ({detail})")
        return None

    def dtype_name(code):
        return str(DTYPES[code]) if 0 <= code < len(DTYPES) else "other"

    checks = [
        (KIND, "the collectives", lambda v: KIND_NAMES.get(v, v)),
        (NAME, "the op names (ranks must issue collectives in the same order)",
         lambda v: f"#{v:x}" if v else "unnamed"),
        (COUNT, "the numbers of tensors", lambda v: v),
        (DTYPE, "the tensor dtypes", dtype_name),
        (DEVICE, "the tensor devices", lambda v: "cuda" if v else "cpu"),
        (NDIM, "the tensor ranks (numbers of dimensions)", lambda v: v),
        (OP, "the reduction ops", lambda v: OP_NAMES.get(v, v)),
        (ROOT, "the root ranks", lambda v: v),
    ]
    for field, label, show in checks:
        error = differs(field, label, show)
        if error is not None:
            return error
    first_dim = SHAPE + 1 if vary_dim0 else SHAPE
    shapes = {rank: [int(x) for x in rec[first_dim:SHAPE + MAX_DIMS] if int(x) >= 0]
              for rank, rec in recs.items()}
    if len({tuple(s) for s in shapes.values()}) > 1:
        detail = ", ".join(f"rank {rank}: {s}" for rank, s in sorted(shapes.items()))
        which = "the tensor shapes (beyond the first dimension)" if vary_dim0 else \
            "the tensor shapes"
        return CollectiveMismatchError(f"{what}: {which} differ across ranks ({detail})")
    return differs(DIGEST, "the tensor shapes or dtypes of the group")
