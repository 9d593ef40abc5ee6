"""Commit-able training state: commit, restore and sync across rounds.

Every rank commits at the same step, so a commit counter identifies a commit
across ranks. Sync compares counters first (newcomers count, with -1) and
moves data only from the newest rank to the ranks that differ; when all agree
nothing moves. Optimizer state is rebuilt from the sender's state_dict, never
by a dummy step, so weight decay cannot nudge the weights.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

import torch

from elastic import protocol
from elastic.checkpoint.checkpointer import Checkpointer, resolve
from elastic.state import handlers, transfer
from elastic.state.snapshot import Arena, Snapshot, host_clone, join, numel_by_dtype, pack, split
from elastic.worker import round_view
from elastic.worker.membership import in_round

if TYPE_CHECKING:
    from elastic.state.transfer import Route
    from elastic.worker.round_view import RoundView

_UNCOMMITTED = -1
Clone = Callable[[torch.Tensor], torch.Tensor]    # copies a tensor out of the snapshot


class State:
    """Base class: subclasses say how to capture and apply their live state.

    A State holds data and snapshots. What it needs of the round it runs in is a
    ``RoundView`` (elastic/worker/round_view.py): the run loop gives it one
    (``use_round``), a test may give a fake. Who acts on a commit listens
    (``add_commit_listener``: the Checkpointer); the commit's collective check and
    what the driver learns of a commit are the round's (``RoundView.check_commit``,
    ``RoundView.committed``).
    """

    _checkpoint: Checkpointer | None = None   # an elastic.Checkpointer (see TorchState), or None

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._commit_listeners: list[Callable[[int, Snapshot], None]] = []
        self._snapshot = Snapshot()
        self._version = _UNCOMMITTED
        self.sync_stats: dict[str, Any] = {"bytes_received": 0, "bytes_sent": 0, "root": None, "syncs": 0,
                           "received_into": None, "copied_into": None}
        self._round_view: RoundView | None = None
        self._bound = False      # no round given: the process's worker's, if any (round_view.current)
        self._arena: Arena | None = None       # touched memory for the first restore's copies (Arena)
        self._reserve_for_sync()

    # -- subclass hooks -----------------------------------------------------------
    def capture(self) -> dict:
        """The live state as a tree of tensors and picklable values."""
        raise NotImplementedError

    def apply(self, tree: dict) -> None:
        """Load a tree produced by capture() into the live objects."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adapt the live objects to a new membership (samplers re-split)."""

    # -- public API ---------------------------------------------------------------
    def register_reset_callbacks(self, callbacks: list) -> None:
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def use_round(self, view: RoundView | None) -> None:
        """Commit and sync in ``view``'s round (None: standalone, a world of one).
        The run loop passes its worker's; without it the process's worker's is used."""
        self._round_view, self._bound = view, True

    def add_commit_listener(self, listener: Callable[[int, Snapshot], None]) -> None:
        """Call ``listener(version, snapshot)`` after each commit is saved, before its
        collective check (a Checkpointer hands the snapshot to its writer there)."""
        self._commit_listeners.append(listener)

    def _round(self) -> RoundView | None:
        return self._round_view if self._bound else round_view.current(connect=True)

    @property
    def commit_version(self) -> int:
        """How many commits this state has made (or adopted); -1 before the first."""
        return self._version

    @property
    def snapshot(self) -> Snapshot:
        """The last commit, in host memory: what restore() loads and a checkpoint writes."""
        return self._snapshot

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The elastic.Checkpointer writing this state, or None."""
        return self._checkpoint

    def adopt(self, tree: dict, version: int) -> None:
        """Make ``tree`` (a capture(), e.g. a loaded checkpoint) the live state and the
        commit numbered ``version``."""
        self.apply(tree)
        self._version = int(version)
        self.save()

    def save(self) -> None:
        if self._checkpoint is not None:
            self._checkpoint.before_save(self._snapshot)   # the writer may still read it
        self._snapshot.save(self.capture())

    def commit(self) -> None:
        """Snapshot to host memory, tell the round and the listeners, then learn
        collectively whether a round is pending (the round's check raises then)."""
        started = time.perf_counter()
        self.save()
        self._version = max(self._version, 0) + 1
        view = self._round()
        if view is not None:
            view.committed(self)
        for listener in self._commit_listeners:
            listener(self._version, self._snapshot)
        self.check_host_updates()
        if view is not None:
            view.progress.timed("commit", time.perf_counter() - started)

    def restore(self) -> None:
        if not self._snapshot.empty:
            tree = self._copies(self._snapshot.materialize(shared=True), self._take_arena())
            self.apply(tree)
            self._remember_live()

    def _copies(self, tree: dict, clone: Clone) -> dict:
        """``tree`` (sharing the snapshot's buffers) with every part apply() would keep
        replaced by a copy made by ``clone``: here every tensor, so the live state never
        aliases the snapshot; TorchState copies only what its handlers keep."""
        return _cloned(tree, clone)

    def _take_arena(self) -> Clone:
        """The clone function for a restore: into the arena once (a newcomer's first
        restore, after its sync), into fresh memory after that."""
        arena, self._arena = self._arena, None
        self.sync_stats["copied_into"] = "arena" if arena is not None else "new"
        return arena.clone if arena is not None else host_clone

    def check_host_updates(self) -> None:
        """One tiny collective, so every rank raises at the same commit: for a new
        round, a rank leaving (SIGTERM to it) or elasticrun stopping (the round's
        ``check_commit``, whose typed result it does not need)."""
        view = self._round()
        if view is not None:
            view.check_commit(self._version)

    def sync(self) -> None:
        """Bring every rank to the newest commit, moving bytes only where needed."""
        view = self._round()
        started = time.perf_counter()
        if self._checkpoint is not None:
            self._checkpoint.before_sync(self, view)   # rank 0 of a fresh job loads the newest
        self.sync_stats["syncs"] += 1
        if view is None:
            self._after_sync(max(self._version, 0))
            return
        live = split(self.capture()) if self._version != _UNCOMMITTED else None
        ready = live is not None and self._snapshot.unchanged(live[1])
        mine = [self._version, int(ready), self._snapshot.layout_id() if ready else 0,
                _max_senders()]
        infos = view.allgather(torch.tensor([mine], dtype=torch.int64)).tolist()
        newest = max(v for v, *_ in infos)
        holders = [r for r, (v, *_) in enumerate(infos) if v == newest]
        rt = transfer.route([tuple(i[:3]) for i in infos], infos[holders[0]][3])
        self.sync_stats["root"] = rt.root if rt is not None else holders[0]
        me = in_round(view.membership).rank     # a state syncs inside a round
        if rt is not None and me in rt.senders:
            self._send(view, rt, me, live if ready else None)
        elif rt is not None and me in rt.receivers:
            self._receive(view, rt, me)
        self._after_sync(max(newest, 0))
        view.progress.timed("sync", time.perf_counter() - started)

    # -- internals ------------------------------------------------------------------------------
    def _reserve_for_sync(self) -> None:
        """A newcomer builds its state before it registers, so before it is admitted:
        the moment to allocate and touch the buffers its first sync will receive into,
        with the flats rank 0 published at its last commit (``newcomer_spec``). Then
        that sync pays no page faults for the snapshot (received once, in memory in use).
        Only when elastic is initialized and a spec was published (a job already
        running); a stale spec is simply not used (``Snapshot.receive_buffers``)."""
        view = round_view.current()      # never connects: elastic.init() came first, or none
        if view is None:
            return
        try:
            spec = view.read_newcomer_spec(type(self).__qualname__)
            if spec and spec.get("flats"):
                self._snapshot.reserve(spec["flats"], pin=torch.cuda.is_available())
            if spec and spec.get("copies") and not torch.cuda.is_available():
                self._arena = Arena(spec["copies"])   # on a GPU the copies go to the device
        except Exception:  # noqa: BLE001 - only an optimization: the sync allocates then
            self._snapshot.drop_reserve()
            self._arena = None

    def newcomer_spec(self) -> dict:
        """What a State built while the job runs allocates ahead of its first sync: the
        snapshot's flats (dtype, length) and how many elements of each dtype its first
        restore copies (``Snapshot.reserve``, ``Arena``). Rank 0's round publishes it."""
        kept = []
        self._copies(self._snapshot.materialize(shared=True),
                     lambda t: kept.append(t) or t)  # type: ignore[func-returns-value]
        return {"flats": [list(x) for x in self._snapshot.specs()],
                "copies": [list(x) for x in numel_by_dtype(kept)]}

    def _remember_live(self) -> None:
        """The live state now equals the snapshot: a later sync may send the snapshot for it."""
        self._snapshot.remember(split(self.capture())[1])

    def _after_sync(self, version: int) -> None:
        """Ranks that already held the newest commit keep their snapshot, and receivers
        received straight into theirs (``_receive``): no copy either way."""
        self._version = version
        view = self._round()
        if view is not None:
            view.holds(version)           # the driver learns at once that we hold the state
        self._snapshot.drop_reserve()      # not needed (held the commit, or a new layout)
        self._arena = None
        if self._snapshot.empty:
            self.save()

    def _send(self, view: RoundView, rt: Route, me: int,
              live: tuple[Any, list[torch.Tensor]] | None) -> None:
        """Send this rank's share of the commit down the receivers' chain.

        ``live``: the (skeleton, tensors) just captured, when the tensors are unchanged
        since the commit: then the snapshot's flats go as they are, with the live
        skeleton (reset callbacks, an lr rescaled for the new world size, say, run after
        the commit and the newcomers must see their effect). Otherwise (only the root
        gets here then) the live state is packed into fresh buffers first.
        """
        if live is not None:
            header, held = self._snapshot.header(live[0]), self._snapshot.flats()
            assert held is not None, "unchanged() holds only while the flats are intact"
            flats = held
        else:
            header, flats = pack(self.capture())
        group = view.cpu_group
        assert group is not None, "a state syncs inside a round"

        def send() -> int:
            if me == rt.root:
                transfer.relay_header(group, header, rt, me)
            return transfer.send_share(group, flats, rt, me)
        self.sync_stats["bytes_sent"] += view.run_blocking(send, "state send")

    def _receive(self, view: RoundView, rt: Route, me: int) -> None:
        """Receive into the snapshot's own flat buffers when the layout matches (memory
        already touched), else into new ones, forwarding each chunk down the chain as it
        lands; then load the live objects from the snapshot."""
        group = view.cpu_group
        assert group is not None, "a state syncs inside a round"
        header = view.run_blocking(
            lambda: transfer.relay_header(group, None, rt, me), "state header")
        snap = self._snapshot
        if self._checkpoint is not None:
            self._checkpoint.before_save(snap)   # never receive into what the writer reads
        had_reserve = snap.reserved is not None
        flats = snap.receive_buffers(header)
        own = snap.flats()
        in_place = own is not None and len(own) == len(flats) and all(
            a is b for a, b in zip(own, flats))
        self.sync_stats["received_into"] = "snapshot" if in_place else (
            "reserve" if had_reserve and snap.reserved is None else "new")
        try:
            got, forwarded = view.run_blocking(
                lambda: transfer.receive_and_forward(group, flats, rt, me), "state receive")
        except BaseException:
            if in_place:
                # The snapshot is partly overwritten (and an abandoned receive may still
                # write into it): drop it, and snapshot the live state again, which is
                # still the last commit (the run loop syncs after a restore or a commit).
                was_committed = self._version != _UNCOMMITTED
                snap.discard()
                if was_committed:
                    self.save()
            raise
        self.sync_stats["bytes_received"] += got
        self.sync_stats["bytes_sent"] += forwarded
        snap.install(header, flats)
        self.restore()


def _max_senders() -> int:
    """Most ranks that stripe one sync (ELASTIC_SYNC_MAX_SENDERS, default 8); the value
    of the first rank holding the newest commit counts, so all ranks agree."""
    try:
        return max(1, int(os.environ.get(protocol.ENV_SYNC_MAX_SENDERS, "8")))
    except ValueError:
        return 8


class ObjectState(State):
    """Plain picklable attributes (counters, epoch, best loss...)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._object_names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def capture(self) -> dict:
        return {"objects": {name: getattr(self, name) for name in self._object_names}}

    def apply(self, tree: dict) -> None:
        for name, value in tree["objects"].items():
            setattr(self, name, copy.deepcopy(value))


def _cloned(tree: Any, clone: Clone = host_clone) -> Any:
    _skeleton, tensors = split(tree)
    return join(_skeleton, [clone(t) for t in tensors])


class TorchState(ObjectState):
    """A model, its optimizer, samplers and any picklable objects, as attributes.

    Every nn.Module, optimizer, ElasticSampler and object with
    state_dict/load_state_dict (lr schedulers), under any keyword, is committed
    through its handler and restored *in place* (elastic.state.handlers;
    ``register_handler`` adds your own types); everything else by value.
    ``elastic_checkpoint``: an elastic.Checkpointer for durable checkpoints; by
    default one in $ELASTIC_CHECKPOINT_DIR when that is set (``elasticrun
    --checkpoint-dir``); False for none. ``checkpoint=`` is an ordinary attribute,
    except that an elastic.Checkpointer given there is still taken as the option.
    """

    _ROOTS = ("model", "optimizer")   # captured at the top of the tree (checkpoint format)

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 elastic_checkpoint: Checkpointer | str | os.PathLike | bool | None = None,
                 **kwargs: Any) -> None:
        if isinstance(kwargs.get("checkpoint"), Checkpointer):   # the old spelling
            if elastic_checkpoint is not None:
                raise TypeError("give the Checkpointer as elastic_checkpoint= only")
            warnings.warn("TorchState(checkpoint=Checkpointer(...)) is now "
                          "elastic_checkpoint=...", DeprecationWarning, stacklevel=2)
            elastic_checkpoint = kwargs.pop("checkpoint")
        self._horovod: dict[str, Any] = {}   # name -> its Horovod-style handler object
        super().__init__(**kwargs)
        self.model = model
        self.optimizer = optimizer
        self._checkpoint = checkpoint = resolve(elastic_checkpoint)
        if checkpoint is not None:
            # Looked up at each commit: the bench wraps the checkpointer's hooks.
            self.add_commit_listener(lambda version, snap: checkpoint.committed(version, snap))
        for name in self._names():
            handler = handlers.handler_for(getattr(self, name))
            if handlers.is_horovod_style(handler):
                self._horovod[name] = handler(getattr(self, name))

    def __setattr__(self, name: str, value: Any) -> None:
        horovod = self.__dict__.get("_horovod")
        if horovod and name in horovod:
            horovod[name].set_value(value)
        super().__setattr__(name, value)

    def _names(self) -> list[str]:
        return list(self._ROOTS) + self._object_names

    def _handled(self) -> Iterator[tuple[str, Any, handlers.Handler]]:
        """(name, object, Handler) for every attribute that has a (native) handler."""
        for name in self._names():
            if name in self._horovod:
                continue
            obj = getattr(self, name)
            handler = handlers.handler_for(obj) if obj is not None else None
            if isinstance(handler, handlers.Handler):
                yield name, obj, handler

    # -- commit / restore ---------------------------------------------------------------
    def save(self) -> None:
        super().save()
        for handler in self._horovod.values():
            handler.save()

    def restore(self) -> None:
        super().restore()
        for handler in self._horovod.values():
            handler.restore()

    def _copies(self, tree: dict, clone: Clone) -> dict:
        """Load straight from the snapshot where the handler copies out (modules), and
        from copies elsewhere (an optimizer keeps the tensors it is given)."""
        for key in self._ROOTS:
            if key in tree and not self._shares(key):
                tree[key] = _cloned(tree[key], clone)
        objects = tree["objects"]
        for name, (kind, value) in objects.items():
            if not (kind == "state_dict" and self._shares(name)):
                objects[name] = (kind, _cloned(value, clone))
        return tree

    def _shares(self, name: str) -> bool:
        handler = handlers.handler_for(getattr(self, name, None))
        return isinstance(handler, handlers.Handler) and handler.shares

    def capture(self) -> dict:
        tree: dict[str, Any] = {"objects": {}}
        handled = {name: (obj, h) for name, obj, h in self._handled()}
        for key in self._ROOTS:
            if key in handled:
                obj, handler = handled[key]
                tree[key] = handler.capture(obj)
        for name in self._object_names:
            if name in self._horovod:
                continue
            if name in handled:
                obj, handler = handled[name]
                tree["objects"][name] = ("state_dict", handler.capture(obj))
            else:
                tree["objects"][name] = ("value", getattr(self, name))
        return tree

    def apply(self, tree: dict) -> None:
        for key in self._ROOTS:
            obj = getattr(self, key)
            handler = handlers.handler_for(obj) if obj is not None else None
            if key in tree and isinstance(handler, handlers.Handler):
                handler.apply(obj, tree[key])
        for name, (kind, value) in tree["objects"].items():
            if name in self._horovod:
                continue
            live = getattr(self, name, None)
            handler = handlers.handler_for(live) if live is not None else None
            if not isinstance(handler, handlers.Handler):
                setattr(self, name, copy.deepcopy(value))
            elif kind == "state_dict":
                handler.apply(live, value)
            elif hasattr(value, "state_dict"):   # an older checkpoint kept it by value
                handler.apply(live, copy.deepcopy(value.state_dict()))
            else:
                setattr(self, name, copy.deepcopy(value))

    def reset(self) -> None:
        for _name, obj, handler in self._handled():
            handler.reset(obj)

    def sync(self) -> None:
        super().sync()
        for handler in self._horovod.values():
            handler.sync()
        for _name, obj, handler in self._handled():
            handler.after_sync(obj)
