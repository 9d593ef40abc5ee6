"""Nested state as a tree: dicts, lists and tuples whose leaves are tensors or plain
values, split into a skeleton (tensors replaced by TensorRef) and its tensors, and
joined back.

Both state/ (snapshots, sync) and checkpoint/ (the on-disk format) use it, so it sits
below both: the two packages do not import each other (tests/test_structure.py).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch


class TensorRef:
    """Placeholder for the i-th tensor of a tree."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple:
        return (TensorRef, (self.index,))


# Checkpoints pickle their skeletons, so TensorRef keeps the module it was defined in
# before it moved here: checkpoints written before and after read the same.
TensorRef.__module__ = "elastic.state.snapshot"


def _map_leaves(node: Any, leaf: Callable[[Any], Any]) -> Any:
    """Rebuild a tree of dicts, lists and plain tuples, mapping every other node with ``leaf``."""
    if isinstance(node, dict):
        return {k: _map_leaves(v, leaf) for k, v in node.items()}
    if isinstance(node, list):
        return [_map_leaves(v, leaf) for v in node]
    if isinstance(node, tuple) and not hasattr(node, "_fields"):
        return tuple(_map_leaves(v, leaf) for v in node)
    return leaf(node)


def split(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """(skeleton, tensors): the tree with tensors replaced by TensorRef, and the tensors."""
    tensors: list[torch.Tensor] = []

    def leaf(node: Any) -> Any:
        if torch.is_tensor(node):
            tensors.append(node.detach())
            return TensorRef(len(tensors) - 1)
        return copy.deepcopy(node)

    return _map_leaves(tree, leaf), tensors


def join(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of split."""
    return _map_leaves(skeleton, lambda n: tensors[n.index] if isinstance(n, TensorRef) else n)
