"""How TorchState commits and restores each kind of object, in place.

A handler turns a live object into a tree of tensors and plain values, which
the state snapshots, syncs and checkpoints like the rest, and loads such a tree
back into the *same* object. So a GAN's generator, discriminator and their two
optimizers, passed under any keyword, roll back in place: the optimizers keep
updating the live parameters. Objects without a handler are kept by value.

Looked up by ``isinstance``, in this order: handlers registered with
``register_handler`` (newest first), then nn.Module, torch optimizers,
ElasticSampler, and last anything with ``state_dict``/``load_state_dict``
(lr schedulers, GradScaler...).

Horovod's registry is also understood: ``set_handler_registry`` takes
``[(type, HandlerClass), ...]`` where ``HandlerClass(value)`` has ``save()``,
``restore()`` and ``sync()`` (Horovod's StateHandler shape); TorchState then
calls those at commit, restore and sync, as Horovod does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeGuard, Union

import torch


class Handler:
    """Commit and restore one kind of object. Subclass and ``register_handler`` it.

    ``capture(obj)`` returns a tree (dicts, lists, tuples of tensors and picklable
    values); ``apply(obj, tree)`` loads it into ``obj`` in place. ``shares``: apply
    copies out of the tree's tensors (as Module.load_state_dict does), so it may be
    handed the snapshot's own buffers; otherwise it gets fresh copies.
    """

    shares = False

    def capture(self, obj: Any) -> Any:
        raise NotImplementedError

    def apply(self, obj: Any, tree: Any) -> None:
        raise NotImplementedError

    def reset(self, obj: Any) -> None:
        """After a membership change (samplers re-split the rest of the epoch)."""

    def after_sync(self, obj: Any) -> None:
        """After every sync, on every rank."""


class StateDictHandler(Handler):
    """Anything with state_dict()/load_state_dict()."""

    def capture(self, obj: Any) -> Any:
        return obj.state_dict()

    def apply(self, obj: Any, tree: Any) -> None:
        obj.load_state_dict(tree)

    def reset(self, obj: Any) -> None:
        if callable(getattr(obj, "reset", None)):
            obj.reset()


class ModuleHandler(StateDictHandler):
    shares = True   # load_state_dict copies into the live parameters

    def reset(self, obj: Any) -> None:
        pass


class OptimizerHandler(StateDictHandler):
    """load_state_dict keeps the tensors it is given, so it gets copies."""

    def reset(self, obj: Any) -> None:
        pass


class SamplerHandler(StateDictHandler):
    """After a sync every rank re-splits what is left, as Horovod's sampler does."""

    def after_sync(self, obj: Any) -> None:
        obj.reset()


class HorovodHandler:
    """Horovod's StateHandler shape, for ``set_handler_registry`` users: one per object."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


# A Handler instance, or a Horovod-style handler class (instantiated once per object).
AnyHandler = Union[Handler, type]

_registered: list[tuple[type, AnyHandler]] = []   # newest first


_BUILTIN: list[tuple[type, Handler]] = []


def _builtin() -> list[tuple[type, Handler]]:
    if not _BUILTIN:
        from elastic.training.sampler import ElasticSampler
        _BUILTIN.extend([(torch.nn.Module, ModuleHandler()),
                         (torch.optim.Optimizer, OptimizerHandler()),
                         (ElasticSampler, SamplerHandler())])
    return _BUILTIN


def register_handler(cls: type, handler: AnyHandler) -> None:
    """Use ``handler`` (a Handler instance) for TorchState attributes that are ``cls``."""
    if not isinstance(cls, type):
        raise TypeError(f"register_handler needs a type, got {cls!r}")
    if not (isinstance(handler, Handler) or _is_horovod_style(handler)):
        raise TypeError("handler must be an elastic.state.handlers.Handler instance, or a "
                        "Horovod-style handler class with save(), restore() and sync()")
    _registered.insert(0, (cls, handler))


def get_handler_registry() -> list[tuple[type, AnyHandler]]:
    """Horovod's name: the registered (type, handler) pairs, newest first."""
    return list(_registered)


def set_handler_registry(registry: Iterable[tuple[type, AnyHandler]]) -> None:
    """Horovod's name: replace the registered pairs (the built-in handlers stay)."""
    pairs = list(registry)
    for cls, handler in pairs:
        if not isinstance(cls, type) or not (isinstance(handler, Handler)
                                             or _is_horovod_style(handler)):
            raise TypeError(f"bad registry entry ({cls!r}, {handler!r})")
    _registered[:] = pairs


def _is_horovod_style(handler: object) -> TypeGuard[type]:
    return isinstance(handler, type) and all(
        callable(getattr(handler, m, None)) for m in ("save", "restore", "sync"))


def handler_for(obj: Any) -> AnyHandler | None:
    """The Handler for ``obj``, a Horovod-style handler class, or None (kept by value)."""
    for cls, handler in _registered:
        if isinstance(obj, cls):
            return handler
    for cls, handler in _builtin():
        if isinstance(obj, cls):
            return handler
    if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict") and not isinstance(obj, type):
        return _STATE_DICT
    return None


def is_horovod_style(handler: object) -> TypeGuard[type]:
    return _is_horovod_style(handler)


_STATE_DICT = StateDictHandler()
