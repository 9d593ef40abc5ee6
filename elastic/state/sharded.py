"""ShardedState: FSDP2 training state that each rank holds a shard of, resharded live.

Each rank commits only its shard (one flat buffer per dtype, host memory) and a
copy of ``redundancy`` other ranks' shards (its predecessors on a ring), so a
SIGKILL of up to ``redundancy`` workers loses nothing: the survivors hold every
shard between them. After any membership change the model is built again on
the new round's mesh by the user's ``build(mesh)`` and the last whole commit is
redistributed to the new shard layout (shard_plan.plan): rows a rank already
holds are copied locally, the rest move point-to-point once (reshard.py); a
newcomer receives only its shard and its copies. No process restarts.

A commit is kept in two phases: the new shard and copies are made, then the
commit's closing collective runs, and only then does the new commit replace the
old one. A rank whose closing collective failed still holds both, so the
survivors always agree on a commit that is whole (shard_plan.choose_version).
"""

from __future__ import annotations

import io
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import torch

from elastic import protocol
from elastic.exceptions import ElasticError
from elastic.state import handlers, reshard, shard_files, shard_plan
from elastic.state.states import State
from elastic.worker import collectives, fatal, runtime, torch_world
from elastic.worker.waiting import run_blocking

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from elastic.state.shard_plan import Meta

log = logging.getLogger(__name__)
Built = tuple[torch.nn.Module, torch.optim.Optimizer | None]    # what ``build(mesh)`` returns

ENV_REDUNDANCY = "ELASTIC_SHARD_REDUNDANCY"


@dataclass
class Generation:
    """One commit as this rank holds it: its shard and copies, for a world of ``n``."""

    version: int
    n: int
    meta: Meta
    rest: bytes                      # the replicated part, pickled
    shards: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # index -> {dtype: flat}
    whole: bool = False              # own shard and every copy landed

    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for s in self.shards.values()
                   for f in s.values())


def _dumps(tree: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(tree, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


class ShardedState(State):
    """``ShardedState(build, redundancy=1, **objects)``: an FSDP2 model, its optimizer
    and picklable objects (samplers, counters), committed shard by shard.

    ``build(mesh)`` returns ``(model, optimizer)``: the model ``fully_shard``-ed on
    ``mesh`` (a 1-D DeviceMesh over the round's group) and its optimizer. It is
    called at the first sync and after every membership change; use
    ``state.model`` and ``state.optimizer`` in the training loop, never objects
    kept from an earlier round. Models built alike on every rank (same seed) start
    equal; after that every rank's shard comes from the last commit.
    ``checkpoint_dir`` (default: ``sharded`` under elasticrun's ``--checkpoint-dir``):
    each rank also writes its shard of every commit there, in a background thread
    (shard_files.py); a job that starts with nothing in memory, or
    that lost more shards than the redundancy covers, resumes from the newest whole
    commit there, at any world size.
    """

    def __init__(self, build: Callable[[DeviceMesh | None], Built],
                 redundancy: int | None = None, checkpoint_dir: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        if checkpoint_dir is None and os.environ.get(protocol.ENV_CHECKPOINT_DIR):
            checkpoint_dir = os.path.join(os.environ[protocol.ENV_CHECKPOINT_DIR], "sharded")
        self.checkpoint_dir = checkpoint_dir
        self._files = shard_files.ShardWriter(checkpoint_dir) if checkpoint_dir else None
        self._build = build
        degree = os.environ.get(ENV_REDUNDANCY, "1") if redundancy is None else redundancy
        self.redundancy = int(degree)
        if self.redundancy < 0:
            raise ValueError(f"redundancy must be >= 0, not {redundancy!r}")
        self._object_names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._built_for: object = None    # the round group the model was built on
        self._gens: list[Generation] = []    # at most two, oldest first
        self.stats: dict[str, Any] = {"reshard_received": 0, "reshard_sent": 0, "copies_sent": 0,
                      "reshard_s": 0.0, "resumed_from": None, "builds": 0,
                      "handed_off": 0, "hand_off_sent": 0}

    # -- what a commit holds --------------------------------------------------------
    def _objects(self) -> dict[str, tuple[str, Any]]:
        out = {}
        for name in self._object_names:
            obj = getattr(self, name)
            h = handlers.handler_for(obj)
            out[name] = ("state_dict", h.capture(obj)) if isinstance(h, handlers.Handler) \
                else ("value", obj)
        return out

    def _load_objects(self, objects: dict[str, tuple[str, Any]]) -> None:
        for name, (kind, value) in objects.items():
            live = getattr(self, name, None)
            h = handlers.handler_for(live) if live is not None else None
            if kind == "state_dict" and isinstance(h, handlers.Handler):
                h.apply(live, value)
            else:
                setattr(self, name, value)

    def held_bytes(self) -> int:
        """Host bytes of the commits this rank holds (own shard and copies)."""
        return sum(g.nbytes() for g in self._gens)

    @property
    def generations(self) -> list[Generation]:
        return list(self._gens)

    # -- commit -------------------------------------------------------------------------
    def commit(self) -> None:
        started = time.perf_counter()
        gen = self._save(max(self._version, 0) + 1)
        w = runtime.worker()
        if w is not None:
            check = w.agree_on_commit()
        self._promote(gen)
        if w is not None and check.reforms and not check.stopping:
            self._hand_off(w, check, gen)
        if self._files is not None:
            me = _rank_size()[0]
            self._files.write(gen.version, gen.n, me, gen.meta, gen.shards[me], gen.rest)
        if w is not None:
            w.progress.committed()
            w.progress.holds = self._version
            if self._files is not None:     # the driver's holders.py: a checkpoint exists
                w.progress.durable = max(w.progress.durable, self._files.durable)
            w.progress.timed("commit", time.perf_counter() - started)
            w.act_on_commit(check, self._version)

    def _hand_off(self, w: Any, check: Any, gen: Generation) -> None:
        """Before the round re-forms: ranks that leave now (SIGTERM, or not in the new
        round) are alive, so each shard that only leavers hold goes to a stayer first,
        whatever the redundancy. The next sync then finds every shard held."""
        me, _n = _rank_size()
        held = collectives.allgather_object((w.leaves_at(check), sorted(gen.shards)))
        moves = shard_plan.hand_off(held)
        if not moves:
            return
        got, sent = run_blocking(
            lambda: reshard.hand_off(w.cpu_group, me, moves, gen.meta, gen.n, gen.shards),
            "shard hand-off", w)
        gen.shards.update(got)
        self.stats["handed_off"] += len(got)
        self.stats["hand_off_sent"] += sent

    def save(self) -> None:
        """Commit the live state again as the current version (no collective check)."""
        self._promote(self._save(max(self._version, 0)))

    def _save(self, version: int) -> Generation:
        """A Generation of the live state: own shard copied, copies exchanged."""
        meta, sharded, rest = _parts().split_live(self.model, self.optimizer)
        me, n = _rank_size()
        gen = Generation(version, n, meta, _dumps({"parts": rest, "objects": self._objects(),
                                                   "meta": meta, "n": n}))
        # Until the new commit is whole, the older whole ones stay (a peer may die now).
        self._gens = [g for g in self._gens if g.whole][-2:] + [gen]
        own = reshard.empty_shard(meta, n, me)
        views = reshard.shard_views(meta, n, me, own)
        for key, t in sharded.items():
            views[key].copy_(t)
        gen.shards[me] = own
        w = runtime.worker()
        if w is not None and n > 1 and self.redundancy:
            group = w.cpu_group
            assert group is not None, "a world of n > 1: this worker is in a round"
            kept, sent = run_blocking(
                lambda: reshard.exchange_copies(group, me, n, self.redundancy, meta, own),
                "shard copies", w)
            gen.shards.update(kept)
            self.stats["copies_sent"] += sent
        gen.whole = True
        return gen

    def _promote(self, gen: Generation) -> None:
        self._gens = [gen]
        self._version = gen.version

    # -- restore / sync -------------------------------------------------------------------
    def restore(self) -> None:
        """Nothing to do here: the next sync builds the model again from the last commit."""

    def on_reset(self) -> None:
        for name in self._object_names:
            obj = getattr(self, name)
            h = handlers.handler_for(obj)
            if isinstance(h, handlers.Handler):
                h.reset(obj)
        for callback in self._reset_callbacks:
            callback()

    def sync(self) -> None:
        started = time.perf_counter()
        self.sync_stats["syncs"] += 1
        me, n = _rank_size()
        self._rebuild()
        if self._files is not None:
            self._files.wait()      # so every survivor lists the same whole checkpoints
        mine = [(g.version, g.n, sorted(g.shards)) for g in self._gens if g.whole]
        holdings = collectives.allgather_object(mine) if runtime.worker() else [mine]
        try:
            chosen = shard_plan.choose_version(holdings)
        except shard_plan.ShardsLost as exc:
            found = shard_files.whole(self.checkpoint_dir)[:1]
            lost = (f"no surviving worker holds the training state: shard(s) {exc.missing} "
                    f"of commit {exc.version} are lost (more workers were lost than "
                    f"redundancy {self.redundancy} covers)")
            if not found:
                # Every survivor decides alike (the same holdings): the job stops with
                # one line, never trains on with missing shards (worker/fatal.py).
                fatal.stop_job(f"{lost} and there is no sharded checkpoint to resume "
                               f"from; the last commit was {exc.version}")
            if me == 0:
                sys.stderr.write(f"elastic: warning: {lost}; resuming from the newest "
                                 f"sharded checkpoint (commit {found[0][0]} of "
                                 f"{found[0][1]} shards)\n")
                sys.stderr.flush()
            chosen = None
        if chosen is None:
            if shard_files.whole(self.checkpoint_dir):
                self._resume_from_checkpoint(me, n)
            else:
                self._promote(self._save(0))       # a fresh job: the models as built
            self._after(started)
            return
        version, old_n = chosen
        root = min(r for r, held in enumerate(holdings) for v, k, _s in held
                   if (v, k) == chosen)
        gen = next((g for g in self._gens if (g.version, g.n) == chosen), None)
        if runtime.worker():
            rest = collectives.broadcast_object(_rest_of(gen) if me == root else None, root)
        else:
            rest = _rest_of(gen)
        tree = _loads(rest)
        meta = tree["meta"]
        holders: dict[int, list[int]] = {}
        for r, held in enumerate(holdings):
            for v, k, shards in held:
                if (v, k) == chosen:
                    for i in shards:
                        holders.setdefault(i, []).append(r)
        pieces = shard_plan.plan(meta, old_n, holders, n)
        views = {i: reshard.shard_views(meta, old_n, i, flats)
                 for i, flats in (gen.shards.items() if gen is not None else ())}
        w = runtime.worker()
        moved = time.perf_counter()
        dest = _parts().local_params(self.model)        # rows land in the model in place
        shards, got, sent = run_blocking(
            lambda: reshard.reshard(w.cpu_group if w else None, me, pieces, meta, old_n, n,
                                    views, dest), "reshard", w) if w else \
            reshard.reshard(None, me, pieces, meta, old_n, n, views, dest)
        self.stats["reshard_s"] = time.perf_counter() - moved
        self.stats["reshard_received"] += got
        self.stats["reshard_sent"] += sent
        self.sync_stats["bytes_received"] += got
        self.sync_stats["bytes_sent"] += sent
        _parts().load_live(self.model, self.optimizer, tree["parts"], shards)
        self._load_objects(tree["objects"])
        self.stats["resumed_from"] = version
        self._promote(self._save(version))    # the new layout, with its copies
        self._after(started)

    def _resume_from_checkpoint(self, me: int, n: int) -> None:
        """Resume from the newest whole commit on disk that every rank reads and verifies;
        one that any rank cannot use gives one warning line and the previous one is tried
        (every rank lists the same whole commits: they waited for their writers)."""
        why = ""
        for version, old_n, folder in shard_files.whole(self.checkpoint_dir):
            try:
                read, why = shard_files.read_for(folder, old_n, n, me), ""
            except (shard_files.CorruptShard, OSError) as exc:
                read, why = None, str(exc)
            bad = [b for b in (collectives.allgather_object(why) if runtime.worker()
                               else [why]) if b]
            if not bad:
                self._resume_from_files(version, old_n, folder, me, n, read)
                return
            why = bad[0]
            if me == 0:
                sys.stderr.write(f"elastic: warning: sharded checkpoint {folder} cannot be "
                                 f"used ({why}); trying the previous one\n")
                sys.stderr.flush()
        fatal.stop_job(f"no sharded checkpoint in {self.checkpoint_dir} can be used ({why})")

    def _resume_from_files(self, version: int, old_n: int, folder: str, me: int, n: int,
                           read: Any) -> None:
        """Load this rank's new shard from the files of a whole commit (only those it needs)."""
        meta, rest, flats = read
        views = {i: reshard.shard_views(meta, old_n, i, f) for i, f in flats.items()}
        pieces = [p for p in shard_plan.plan(meta, old_n, {i: list(range(n)) for i in
                                                           range(old_n)}, n) if p.dst == me]
        shards, _got, _sent = reshard.reshard(None, me, pieces, meta, old_n, n, views)
        if rest is None:        # shard 0 holds the replicated part (ShardWriter writes it)
            raise shard_files.CorruptShard(f"{folder}: shard 0 has no replicated part")
        tree = _loads(rest)
        _parts().load_live(self.model, self.optimizer, tree["parts"], shards)
        self._load_objects(tree["objects"])
        self.stats["resumed_from"] = f"{folder} (commit {version} of {old_n} shards)"
        self._promote(self._save(version))

    def _after(self, started: float) -> None:
        for name in self._object_names:
            obj = getattr(self, name)
            h = handlers.handler_for(obj)
            if isinstance(h, handlers.Handler):
                h.after_sync(obj)
        w = runtime.worker()
        if w is not None:
            if w.progress.holds != self._version:
                w.progress.holds = self._version
                w.heartbeat.wake()
            w.progress.timed("sync", time.perf_counter() - started)

    def _rebuild(self) -> None:
        """Build the model and optimizer on this round's mesh (once per round)."""
        group = _round_group()
        if group is self._built_for and self.model is not None:
            return
        from torch.distributed.device_mesh import DeviceMesh
        # The mesh's one dimension is named after the round: torch compares meshes by
        # their ranks and dimension names only, so a later round's mesh of the same ranks
        # would otherwise share DTensor's cached shardings, which hold the old mesh and
        # its ended group (full_tensor() would then fail to resolve that group).
        mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=(group.group_name,)) \
            if group is not None else None
        self.model, self.optimizer = None, None
        model, optimizer = self._build(mesh)
        _parts().check_model(model)
        self.model, self.optimizer = model, optimizer
        self._built_for = group
        self.stats["builds"] += 1

    # -- the State API that does not apply ------------------------------------------------
    def capture(self) -> NoReturn:
        raise ElasticError("ShardedState commits shards; there is no full capture()")

    def apply(self, tree: dict) -> NoReturn:
        raise ElasticError("ShardedState loads shards; there is no full apply()")


def _rest_of(gen: Generation | None) -> bytes:
    """The replicated part of ``gen``, on a rank that holds the commit chosen to resume
    (the root of the sync, chosen from the holdings; standalone, the one rank)."""
    assert gen is not None, "the root holds the chosen commit"
    return gen.rest


def _parts() -> ModuleType:
    """elastic.state.fsdp_parts, imported when first needed (DTensor's import is slow)."""
    from elastic.state import fsdp_parts
    return fsdp_parts


def _round_group() -> dist.ProcessGroup | None:
    group: dist.ProcessGroup | None = torch_world.current()
    if group is None and runtime.ensure_joined() is not None:   # inits; joins between rounds
        group = torch_world.current()
    if group is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        group = torch.distributed.group.WORLD
    return group


def _rank_size() -> tuple[int, int]:
    w = runtime.worker()
    if w is not None and w.membership is not None:
        return w.membership.rank, w.membership.size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1
