"""Nested containers: the one walker every faccel module goes through.

User data arrives as nests of tuples, lists, dicts, named tuples, other
mappings (a tokenizer's ``BatchEncoding``) and attrs records: batches to move,
model outputs to cast, trees to gather or broadcast, metrics, checkpoint
extras. Each kind of container is described once, by a ``_Kind`` record
(chosen by :func:`_kind`): how to list its children with the path fragment that
names each one, how to build one of the same kind from new children, how to
print its shape and how to write it in JSON's types.
Every walk below (flatten with paths, rebuild, map over tensors, walk two
trees together) goes through that table, so a container kind is supported
everywhere or nowhere.

Anything that is not a container is a leaf. ``torch.func`` trees (parameters,
gradients, optimizer states) go through PyTorch's pytree registry instead, in
the sibling module ``_pytree``, because the transforms themselves use it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs
import torch

__all__ = [
    "MISSING",
    "children",
    "flatten_with_paths",
    "map_tensors",
    "paired_leaves",
    "rebuild",
    "to_plain",
]


@attrs.frozen
class _Kind:
    """How one kind of container is taken apart and put back together."""

    # (path fragment, child) for each child, in order.
    items: Callable[[Any], list[tuple[str, Any]]]
    # A container of the same kind as the first argument holding the given children.
    make: Callable[[Any, list[Any]], Any]
    # Text of the container's structure, from its own value and its children's texts.
    shape: Callable[[Any, list[str]], str]
    # The same container in JSON's types (dict or list), holding the given children.
    plain: Callable[[Any, list[Any]], Any]
    # Children are matched by position (sequences), not by name, when two trees are walked together.
    positional: bool = False


def _mapping_make(tree: Mapping[Any, Any], values: list[Any]) -> Any:
    rebuilt = dict(zip(tree.keys(), values, strict=True))
    if type(tree) is dict:
        return rebuilt
    if isinstance(tree, defaultdict):
        return type(tree)(tree.default_factory, rebuilt)
    return type(tree)(rebuilt)  # type: ignore[call-arg]


def _mapping_shape(tree: Mapping[Any, Any], parts: list[str]) -> str:
    name = "" if type(tree) is dict else type(tree).__qualname__
    return name + "{" + ", ".join(f"{key!r}: {part}" for key, part in zip(tree, parts, strict=True)) + "}"


def _fields_shape(tree: Any, names: Iterable[str], parts: list[str]) -> str:
    inner = ", ".join(f"{name}={part}" for name, part in zip(names, parts, strict=True))
    return f"{type(tree).__qualname__}({inner})"


def _attrs_fields(tree: Any) -> list[attrs.Attribute]:  # type: ignore[type-arg]
    # Only what __init__ takes: a record is rebuilt through attrs.evolve.
    return [f for f in attrs.fields(type(tree)) if f.init]


_NAMEDTUPLE = _Kind(
    items=lambda t: [(f".{name}", item) for name, item in zip(t._fields, t, strict=True)],
    make=lambda t, values: type(t)(*values),
    shape=lambda t, parts: _fields_shape(t, t._fields, parts),
    plain=lambda t, values: values,  # as json.dumps writes a named tuple
    positional=True,  # still a tuple: it pairs with a plain tuple or list of its length
)
_TUPLE = _Kind(
    items=lambda t: [(f"[{i}]", item) for i, item in enumerate(t)],
    make=lambda t, values: type(t)(values),
    shape=lambda t, parts: "(" + ", ".join(parts) + ",)",
    plain=lambda t, values: values,
    positional=True,
)
_LIST = _Kind(
    items=lambda t: [(f"[{i}]", item) for i, item in enumerate(t)],
    make=lambda t, values: values,
    shape=lambda t, parts: "[" + ", ".join(parts) + "]",
    plain=lambda t, values: values,
    positional=True,
)
_MAPPING = _Kind(
    items=lambda t: [(f"[{key!r}]", value) for key, value in t.items()],
    make=_mapping_make,
    shape=_mapping_shape,
    plain=lambda t, values: dict(zip(t.keys(), values, strict=True)),
)
_ATTRS = _Kind(
    items=lambda t: [(f".{f.name}", getattr(t, f.name)) for f in _attrs_fields(t)],
    make=lambda t, values: attrs.evolve(
        t, **{str(f.alias): v for f, v in zip(_attrs_fields(t), values, strict=True)}
    ),
    shape=lambda t, parts: _fields_shape(t, [f.name for f in _attrs_fields(t)], parts),
    plain=lambda t, values: {f.name: v for f, v in zip(_attrs_fields(t), values, strict=True)},
)


def _kind(tree: Any) -> _Kind | None:
    """The container kind of ``tree``, or None for a leaf."""
    if isinstance(tree, tuple):
        return _NAMEDTUPLE if hasattr(tree, "_fields") else _TUPLE
    if isinstance(tree, list):
        return _LIST
    if isinstance(tree, Mapping):
        return _MAPPING
    if attrs.has(type(tree)):
        return _ATTRS
    return None


def children(tree: Any) -> list[tuple[str, Any]] | None:
    """``(path fragment, child)`` for each child of the container ``tree``; None for a leaf.

    Example:
        >>> children({"a": 1, "b": [2]})
        [("['a']", 1), ("['b']", [2])]
        >>> children(3) is None
        True
    """
    if isinstance(tree, torch.Tensor):
        return None
    kind = _kind(tree)
    return None if kind is None else kind.items(tree)


def flatten_with_paths(tree: Any, root: str = "tree") -> tuple[list[Any], list[str], str]:
    """The leaves of ``tree`` in order, the path of each, and the tree's structure as text.

    Paths start at ``root`` and name each step: ``.field`` for named tuples and
    records, ``[i]`` for sequences, ``[key!r]`` for mappings. In the structure
    text a tensor leaf is ``T`` and another leaf ``<its type>``, so two trees
    with equal texts can be rebuilt from each other's leaves.

    Example:
        >>> import torch
        >>> leaves, paths, text = flatten_with_paths({"x": torch.ones(1), "ids": [3]})
        >>> paths, text
        (["tree['x']", "tree['ids'][0]"], "{'x': T, 'ids': [<int>]}")
    """
    leaves: list[Any] = []
    paths: list[str] = []

    def walk(node: Any, path: str) -> str:
        kind = None if isinstance(node, torch.Tensor) else _kind(node)
        if kind is None:
            leaves.append(node)
            paths.append(path)
            return "T" if isinstance(node, torch.Tensor) else f"<{type(node).__qualname__}>"
        return kind.shape(node, [walk(child, path + key) for key, child in kind.items(node)])

    text = walk(tree, root)
    return leaves, paths, text


def rebuild(tree: Any, leaves: Iterable[Any]) -> Any:
    """``tree`` with its leaves replaced, in order, by ``leaves``; containers are rebuilt, never mutated.

    Example:
        >>> rebuild({"a": (1, 2), "b": [3]}, [10, 20, 30])
        {'a': (10, 20), 'b': [30]}
    """
    given = iter(leaves)

    def walk(node: Any) -> Any:
        kind = None if isinstance(node, torch.Tensor) else _kind(node)
        if kind is None:
            return next(given)
        return kind.make(node, [walk(child) for _, child in kind.items(node)])

    return walk(tree)


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor; other leaves are kept as they are.

    Example:
        >>> import torch
        >>> map_tensors(lambda t: t * 2, {"x": torch.ones(2), "name": "a"})
        {'x': tensor([2., 2.]), 'name': 'a'}
    """
    # Written out rather than as flatten + rebuild: it runs on every batch (to_device).
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    kind = _kind(tree)
    if kind is None:
        return tree
    return kind.make(tree, [map_tensors(fn, child) for _, child in kind.items(tree)])


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


# Stands for "no counterpart in the other tree" in :func:`paired_leaves`.
MISSING: Any = _Missing()


def paired_leaves(tree: Any, other: Any, root: str = "tree") -> Iterator[tuple[str, Any, Any]]:
    """``(path, leaf, counterpart)`` for every leaf of ``tree``, walking ``other`` alongside.

    The counterpart is what ``other`` holds at the same place: a leaf, a whole
    container (where ``other`` is deeper), or :data:`MISSING` where ``other``
    has no such place. Named children (mapping keys, fields) are matched by
    name; sequences only when both are sequences of the same length.

    Example:
        >>> list(paired_leaves({"a": 1, "b": [2, 3]}, {"a": "x", "b": [4]}))
        [("tree['a']", 1, 'x'), ("tree['b'][0]", 2, MISSING), ("tree['b'][1]", 3, MISSING)]
    """
    kind = None if isinstance(tree, torch.Tensor) else _kind(tree)
    if kind is None:
        yield root, tree, other
        return
    other_kind = None if other is MISSING or isinstance(other, torch.Tensor) else _kind(other)
    items = kind.items(tree)
    counterparts = [MISSING] * len(items)
    if other_kind is not None and other_kind.positional == kind.positional:
        other_items = other_kind.items(other)
        if not kind.positional:
            by_key = dict(other_items)
            counterparts = [by_key.get(key, MISSING) for key, _ in items]
        elif len(other_items) == len(items):
            counterparts = [value for _, value in other_items]
    for (key, child), counterpart in zip(items, counterparts, strict=True):
        yield from paired_leaves(child, counterpart, root + key)


def to_plain(tree: Any) -> Any:
    """``tree`` in JSON's own container types: mappings and records become dicts, sequences lists.

    Example:
        >>> import collections
        >>> Point = collections.namedtuple("Point", "x y")
        >>> to_plain({"p": Point(1, 2), "t": (3,)})
        {'p': [1, 2], 't': [3]}
    """
    kind = None if isinstance(tree, torch.Tensor) else _kind(tree)
    if kind is None:
        return tree
    return kind.plain(tree, [to_plain(child) for _, child in kind.items(tree)])
