"""Records as pytrees: the one module that uses torch's pytree registry (through ``_torch_compat``).

``torch.func`` transforms and ``tree_map`` walk nested containers through
PyTorch's pytree registry, which is a private API. Every faccel module goes
through this one, so a change in PyTorch is fixed here only.

A record registered with :func:`register_pytree` flattens to the values of its
fields, except fields declared with :func:`static_field`: those (a step count,
hyperparameters) ride in the tree's structure, as flax's
``pytree_node=False`` does, so transforms never see them as leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import attrs
import torch

from faccel._torch_compat import pytree as _pytree
from faccel.errors import ArgumentError

__all__ = [
    "TreeSpec",
    "flatten",
    "keystr",
    "register_pytree",
    "same_structure",
    "static_field",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "unflatten",
]

T = TypeVar("T")
TreeSpec = _pytree.TreeSpec

_STATIC = "faccel.static"

tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_leaves = _pytree.tree_leaves
tree_flatten_with_path = _pytree.tree_flatten_with_path
keystr = _pytree.keystr


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """``tree_flatten`` with a fast path for the per-step case, a flat dict of tensors.

    Returns the leaves and a structure token for :func:`unflatten`: the dict's
    keys as a tuple, or a ``TreeSpec``. torch's generic walk costs about a
    microsecond a leaf, which on a small model's step is a visible share; the
    dict path costs a tenth of that. Compare tokens with :func:`same_structure`.
    """
    if type(tree) is dict and all(type(v) is torch.Tensor for v in tree.values()):
        return list(tree.values()), tuple(tree)
    return _pytree.tree_flatten(tree)


def unflatten(leaves: list[Any], token: Any) -> Any:
    """The tree of structure ``token`` (from :func:`flatten`) holding ``leaves``."""
    if type(token) is tuple:
        return dict(zip(token, leaves, strict=True))
    return _pytree.tree_unflatten(leaves, token)


def same_structure(a: Any, token_a: Any, b: Any, token_b: Any) -> bool:
    """Whether trees ``a`` and ``b`` (with their tokens from :func:`flatten`) match."""
    if token_a == token_b:
        return True
    if type(token_a) is type(token_b):
        return False
    # One took the dict fast path and the other did not (a Parameter among the values).
    return bool(_pytree.tree_structure(a) == _pytree.tree_structure(b))


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Apply ``fn`` to every leaf of ``tree`` (and the matching leaves of ``rest``).

    PyTorch's own ``tree_map``, re-exported so that user code needs no private
    import. Registered records (:func:`register_pytree`) are walked field by
    field; their static fields are carried over unchanged.

    Args:
        fn: Called with one leaf of each tree.
        tree: Any nest of tuples, lists, dicts and registered records.
        *rest: Trees of the same structure as ``tree``.

    Returns:
        A tree of the same structure holding ``fn``'s results.

    Example:
        >>> import torch, faccel
        >>> faccel.func.tree_map(lambda a, b: a + b, {"w": torch.ones(2)}, {"w": torch.ones(2)})
        {'w': tensor([2., 2.])}
    """
    return _pytree.tree_map(fn, tree, *rest)


def static_field(**kwargs: Any) -> Any:
    """An ``attrs.field`` kept out of the leaves of a :func:`register_pytree` record.

    Static values live in the tree's structure: ``tree_map`` and ``torch.func``
    transforms pass them through untouched, and two trees whose static values
    differ have different structures. Use it for step counts, hyperparameters
    and other Python values; they must be hashable and comparable with ``==``.

    Args:
        **kwargs: Passed to ``attrs.field`` (``default=``, ``validator=``...).

    Returns:
        The field definition.

    Example:
        >>> import attrs, torch, faccel
        >>> @faccel.func.register_pytree
        ... @attrs.frozen(kw_only=True)
        ... class Counter:
        ...     total: torch.Tensor
        ...     step: int = faccel.func.static_field(default=0)
        >>> faccel.func.tree_map(lambda t: t + 1, Counter(total=torch.zeros(1), step=3))
        Counter(total=tensor([1.]), step=3)
    """
    metadata = {**kwargs.pop("metadata", {}), _STATIC: True}
    return attrs.field(metadata=metadata, **kwargs)


def _is_static(field: attrs.Attribute) -> bool:  # type: ignore[type-arg]
    return bool(field.metadata.get(_STATIC, False))


def register_pytree(cls: type[T]) -> type[T]:
    """Register the attrs class ``cls`` as a pytree node; returns ``cls``.

    Its fields become children in declaration order, except those declared
    with :func:`static_field`, which are kept in the tree's structure, as are
    children whose value is ``None`` (torch's pytree would make ``None`` a
    leaf, which ``torch.func`` transforms refuse).
    Unflattening rebuilds an instance without running ``__init__`` (validators
    and converters are skipped), because transforms put other things than
    tensors in the leaves (``tree_map(lambda t: t.shape, ...)``, functorch's
    wrapped tensors). Key paths name the fields (``tree_flatten_with_path``).

    Use it as a decorator above ``@attrs.frozen``. Registering a class twice is
    a no-op.

    Args:
        cls: An attrs class.

    Returns:
        ``cls`` itself.

    Raises:
        ArgumentError: ``cls`` is not an attrs class.

    Example:
        >>> import attrs, torch, faccel
        >>> @faccel.func.register_pytree
        ... @attrs.frozen(kw_only=True)
        ... class Pair:
        ...     a: torch.Tensor
        ...     b: torch.Tensor
        ...     name: str = faccel.func.static_field(default="pair")
        >>> from faccel._torch_compat import pytree
        >>> leaves, spec = pytree.tree_flatten(Pair(a=torch.zeros(1), b=torch.ones(1)))
        >>> len(leaves), pytree.tree_unflatten(leaves, spec).name
        (2, 'pair')
    """
    registered: type[T] = cls  # attrs.has() narrows cls's type below
    if not attrs.has(cls):
        msg = (
            f"register_pytree() needs an attrs class, got {cls!r}; "
            "decorate the class with @attrs.frozen(kw_only=True) below @register_pytree"
        )
        raise ArgumentError(msg)
    if cls in _pytree.SUPPORTED_NODES:
        return registered
    fields = attrs.fields(cls)
    children = tuple(f.name for f in fields if not _is_static(f))
    statics = tuple(f.name for f in fields if _is_static(f))
    keys = tuple(_pytree.GetAttrKey(name) for name in children)

    # A child that is None (an optional tree, e.g. AMSGrad's maximum when off) is
    # recorded in the structure, not passed as a leaf: torch's pytree counts None
    # as a leaf, which torch.func transforms refuse (vmap, grad want tensors).
    def flatten(obj: Any) -> tuple[list[Any], Any]:
        values = [getattr(obj, n) for n in children]
        absent = tuple(v is None for v in values)
        context = (tuple(getattr(obj, n) for n in statics), absent)
        return [v for v in values if v is not None], context

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
        values, context = flatten(obj)
        present = [key for key, gone in zip(keys, context[1], strict=True) if not gone]
        return list(zip(present, values, strict=True)), context

    def unflatten(values: Iterable[Any], context: Any) -> Any:
        static_values, absent = context
        obj = object.__new__(cls)
        given = iter(values)
        # attrs' frozen classes are built the same way: through object.__setattr__.
        for name, gone in zip(children, absent, strict=True):
            object.__setattr__(obj, name, None if gone else next(given))
        for name, value in zip(statics, static_values, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    _pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )
    return registered
