"""Commit-able training state: commit, restore and sync across rounds.

Every rank commits at the same step, so a commit counter identifies a commit
across ranks. Sync compares counters first (newcomers count, with -1) and
moves data only from the newest rank to the ranks that differ; when all agree
nothing moves. Optimizer state is rebuilt from the sender's state_dict, never
by a dummy step, so weight decay cannot nudge the weights.
"""

from __future__ import annotations

import copy
import warnings

import torch

from elastic.exceptions import HostsUpdatedInterrupt
from elastic.state import handlers
from elastic.state.snapshot import Snapshot, host_clone, join, pack, split
from elastic.worker import collectives, runtime
from elastic.worker.waiting import issue, wait

_UNCOMMITTED = -1


class State:
    """Base class: subclasses say how to capture and apply their live state."""

    _checkpoint = None   # an elastic.Checkpointer (see TorchState), or None

    def __init__(self):
        self._reset_callbacks = []
        self._snapshot = Snapshot()
        self._version = _UNCOMMITTED
        self.sync_stats = {"bytes_received": 0, "bytes_sent": 0, "root": None, "syncs": 0}

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

    @property
    def commit_version(self) -> int:
        """How many commits this state has made (or adopted); -1 before the first."""
        return self._version

    @property
    def snapshot(self) -> Snapshot:
        """The last commit, in host memory: what restore() loads and a checkpoint writes."""
        return self._snapshot

    @property
    def checkpointer(self):
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
            self._checkpoint.before_save(self)   # the writer may still read the snapshot
        self._snapshot.save(self.capture())

    def commit(self) -> None:
        """Snapshot to host memory, then learn collectively whether a round is pending."""
        self.save()
        self._version = max(self._version, 0) + 1
        if self._checkpoint is not None:
            self._checkpoint.after_commit(self)
        self.check_host_updates()

    def restore(self) -> None:
        if not self._snapshot.empty:
            self.apply(self._snapshot.materialize())

    def check_host_updates(self) -> None:
        """One tiny collective, so every rank raises at the same commit."""
        w = runtime.worker()
        if w is None:
            return
        flag = torch.tensor([1 if w.new_round_pending() else 0], dtype=torch.int32)
        collectives.allreduce_(flag, collectives.Max)
        if int(flag) > 0:
            raise HostsUpdatedInterrupt()

    def sync(self) -> None:
        """Bring every rank to the newest commit, moving bytes only where needed."""
        w = runtime.worker()
        if self._checkpoint is not None:
            self._checkpoint.before_sync(self)   # rank 0 of a fresh job loads the newest
        self.sync_stats["syncs"] += 1
        if w is None:
            self._after_sync(max(self._version, 0))
            return
        versions = collectives.allgather(torch.tensor([self._version], dtype=torch.int64)).tolist()
        newest = max(versions)
        receivers = [r for r, v in enumerate(versions) if v != newest]
        if newest == _UNCOMMITTED:
            root, receivers = 0, list(range(1, len(versions)))
        else:
            root = versions.index(newest)
        self.sync_stats["root"] = root
        me = w.membership.rank
        if receivers and me == root:
            self._send(receivers)
        elif me in receivers:
            self._receive(root)
        self._after_sync(max(newest, 0))

    # -- internals ------------------------------------------------------------------
    def _after_sync(self, version):
        """Ranks that already held the newest commit keep their snapshot, and receivers
        received straight into theirs (``_receive``): no copy either way."""
        self._version = version
        if self._snapshot.empty:
            self.save()

    def _send(self, receivers):
        """Send the live state, flattened per dtype, to every receiver at once.

        Live, not the snapshot: reset callbacks (an lr rescaled for the new world
        size, say) run after the last commit, and the newcomer must see their effect.
        """
        header, flats = pack(self.capture())
        header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        length = torch.tensor([header_t.numel()], dtype=torch.int64)
        w = runtime.worker()
        for tensor in [length, header_t] + [f for f in flats if f.numel()]:
            works = [issue(lambda t=tensor, d=dst: w.cpu_group.send([t], d, 0), "send")
                     for dst in receivers]
            for work in works:
                wait(work, "send", w)
            if tensor.numel() and tensor is not length and tensor is not header_t:
                self.sync_stats["bytes_sent"] += \
                    tensor.numel() * tensor.element_size() * len(receivers)

    def _receive(self, root):
        """Receive into the snapshot's own flat buffers when the layout matches (memory
        already touched), else into new ones; then load the live objects from it."""
        length = collectives.recv(torch.zeros(1, dtype=torch.int64), root)
        header_t = collectives.recv(torch.empty(int(length), dtype=torch.uint8), root)
        header = header_t.numpy().tobytes()
        snap = self._snapshot
        if self._checkpoint is not None:
            self._checkpoint.before_save(self)   # never receive into what the writer reads
        flats = snap.receive_buffers(header)
        own = snap.flats()
        in_place = own is not None and len(own) == len(flats) and all(
            a is b for a, b in zip(own, flats))
        try:
            for flat in flats:
                if flat.numel():
                    collectives.recv(flat, root)
                    self.sync_stats["bytes_received"] += flat.numel() * flat.element_size()
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
        snap.install(header, flats)
        self.restore()


class ObjectState(State):
    """Plain picklable attributes (counters, epoch, best loss...)."""

    def __init__(self, **kwargs):
        super().__init__()
        self._object_names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def capture(self):
        return {"objects": {name: getattr(self, name) for name in self._object_names}}

    def apply(self, tree):
        for name, value in tree["objects"].items():
            setattr(self, name, copy.deepcopy(value))


def _cloned(tree):
    _skeleton, tensors = split(tree)
    return join(_skeleton, [host_clone(t) for t in tensors])


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

    def __init__(self, model=None, optimizer=None, elastic_checkpoint=None, **kwargs):
        from elastic.checkpoint.checkpointer import Checkpointer, resolve
        if isinstance(kwargs.get("checkpoint"), Checkpointer):   # the old spelling
            if elastic_checkpoint is not None:
                raise TypeError("give the Checkpointer as elastic_checkpoint= only")
            warnings.warn("TorchState(checkpoint=Checkpointer(...)) is now "
                          "elastic_checkpoint=...", DeprecationWarning, stacklevel=2)
            elastic_checkpoint = kwargs.pop("checkpoint")
        self._horovod = {}
        super().__init__(**kwargs)
        self.model = model
        self.optimizer = optimizer
        self._checkpoint = resolve(elastic_checkpoint)
        for name in self._names():
            handler = handlers.handler_for(getattr(self, name))
            if handlers.is_horovod_style(handler):
                self._horovod[name] = handler(getattr(self, name))

    def __setattr__(self, name, value):
        horovod = self.__dict__.get("_horovod")
        if horovod and name in horovod:
            horovod[name].set_value(value)
        super().__setattr__(name, value)

    def _names(self):
        return list(self._ROOTS) + self._object_names

    def _handled(self):
        """(name, object, Handler) for every attribute that has a (native) handler."""
        for name in self._names():
            if name in self._horovod:
                continue
            obj = getattr(self, name)
            handler = handlers.handler_for(obj) if obj is not None else None
            if isinstance(handler, handlers.Handler):
                yield name, obj, handler

    # -- commit / restore ---------------------------------------------------------------
    def save(self):
        super().save()
        for handler in self._horovod.values():
            handler.save()

    def restore(self):
        """Load straight from the snapshot where the handler copies out (modules), and
        from copies elsewhere (an optimizer keeps the tensors it is given)."""
        if not self._snapshot.empty:
            tree = self._snapshot.materialize(shared=True)
            for key in self._ROOTS:
                if key in tree and not self._shares(key):
                    tree[key] = _cloned(tree[key])
            objects = tree["objects"]
            for name, (kind, value) in objects.items():
                if not (kind == "state_dict" and self._shares(name)):
                    objects[name] = (kind, _cloned(value))
            self.apply(tree)
        for handler in self._horovod.values():
            handler.restore()

    def _shares(self, name):
        handler = handlers.handler_for(getattr(self, name, None))
        return isinstance(handler, handlers.Handler) and handler.shares

    def capture(self):
        tree = {"objects": {}}
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

    def apply(self, tree):
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

    def reset(self):
        for _name, obj, handler in self._handled():
            handler.reset(obj)

    def sync(self):
        super().sync()
        for handler in self._horovod.values():
            handler.sync()
        for _name, obj, handler in self._handled():
            handler.after_sync(obj)
