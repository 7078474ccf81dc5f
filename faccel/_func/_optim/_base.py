"""The pure optimizer protocol, and what the optimizers share.

``opt.init(params) -> state`` and ``opt.update(grads, state, params, *,
lr=None) -> (new_params, new_state)``, in optax's shape: nothing is modified,
new tensors come back. Anything with these two methods is an optimizer to
:class:`faccel.func.FunctionalState`; a new one is a new module, not an edit
of the functional code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from faccel._tree import flatten, same_structure, tree_map, unflatten
from faccel.errors import ArgumentValueError, FunctionalError

__all__ = ["Optimizer", "check", "leaves_like", "state_from_dict", "state_to_dict", "zeros_like"]


@runtime_checkable
class Optimizer(Protocol):
    """A pure optimizer: ``init`` makes its state, ``update`` returns new parameters and state.

    :func:`faccel.func.sgd`, :func:`faccel.func.adamw` and
    :func:`faccel.func.param_groups` make one; so can your own module. The
    contract, which :class:`faccel.func.FunctionalState` relies on:

    * The optimizer is a frozen, hashable record (``attrs.frozen``): it rides
      in a ``FunctionalState``'s tree structure as a static field.
    * ``init(params)`` returns the state before the first update: an attrs
      record registered with :func:`faccel.func.register_pytree`, its tensors
      in trees shaped like ``params`` (or ``None``), plain Python values (a
      step count) in static fields. It must work on tensors on the ``meta``
      device: ``FunctionalState.from_state_dict`` checks a restored state
      against ``init`` of meta copies of the parameters, which allocates nothing.
    * ``update(grads, state, params, *, lr=None)`` returns ``(new_params,
      new_state)``, modifying nothing given; ``grads`` is a tree like
      ``params``; ``lr``, when given, replaces the learning rate for this
      update (how a schedule plugs in).

    Example:
        >>> import faccel
        >>> isinstance(faccel.func.adamw(), faccel.func.Optimizer)
        True
    """

    def init(self, params: Any) -> Any:
        """The state before the first update."""
        ...

    def update(self, grads: Any, state: Any, params: Any, *, lr: float | None = None) -> tuple[Any, Any]:
        """One update: ``(new_params, new_state)``; nothing given is modified.

        Args:
            grads: Gradients, a tree like ``params``.
            state: The state from :meth:`init` or the previous update.
            params: The parameters, a tree of floating-point tensors.
            lr: This step's learning rate, for schedules (default: the optimizer's own).

        Returns:
            The updated parameters and state.

        Raises:
            FunctionalError: The trees' structures differ, or ``state`` was not
                made by this optimizer's configuration.
        """
        ...


def check(condition: bool, message: str) -> None:
    """Raise :class:`ArgumentValueError` with ``message`` unless ``condition`` holds (a bad setting)."""
    if not condition:
        raise ArgumentValueError(message)


def leaves_like(tree: Any, params: Any, spec: Any, what: str) -> list[Any]:
    """The leaves of ``tree``, which must have the structure ``spec`` of ``params``."""
    leaves, found = flatten(tree)
    if not same_structure(tree, found, params, spec):
        msg = (
            f"{what} must have the structure of params, got {found} for params' {spec}; "
            "pass gradients and a state made by this optimizer's init() for the same params"
        )
        raise FunctionalError(msg)
    return leaves


def zeros_like(leaves: list[torch.Tensor], spec: Any) -> Any:
    """A tree of structure ``spec`` holding zeros shaped like ``leaves``."""
    return unflatten([torch.zeros_like(p) for p in leaves], spec)


def state_to_dict(state: Any) -> dict[str, Any]:
    """An optimizer state record as nested dicts of tensors and plain values; nothing is copied."""
    return attrs.asdict(state, recurse=True)


def state_from_dict(optimizer: Optimizer, saved: Mapping[str, Any], params: Any) -> Any:
    """The state record that :func:`state_to_dict` described, checked against ``optimizer`` and ``params``.

    The expected shape is ``optimizer.init`` of meta-device copies of
    ``params``: the same record types, fields, ``None``s and tree structures,
    tensors of the same shapes, plain values of the same types.
    """
    meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, params)
    template = optimizer.init(meta)
    return _rebuild(template, saved, "", optimizer)


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} tensor"
    return type(value).__name__


def _rebuild(template: Any, saved: Any, path: str, optimizer: Optimizer) -> Any:
    def misfit(expected: str) -> FunctionalError:
        msg = (
            f"the saved optimizer state's {path.lstrip('.') or 'record'} does not fit {optimizer!r} and "
            f"these parameters (expected {expected}, got {_describe(saved)}); restore with the "
            "optimizer the state was trained with"
        )
        return FunctionalError(msg)

    if attrs.has(type(template)):
        names = [field.name for field in attrs.fields(type(template))]
        if not isinstance(saved, Mapping) or set(saved) != set(names):
            raise misfit(f"a {type(template).__name__} as a dict of {sorted(names)}")
        return type(template)(
            **{
                name: _rebuild(getattr(template, name), saved[name], f"{path}.{name}", optimizer)
                for name in names
            }
        )
    if template is None:
        if saved is not None:
            raise misfit("None")
        return None
    if isinstance(template, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != template.shape:
            raise misfit(f"a tree like params ({_describe(template)})")
        return saved
    if isinstance(template, Mapping):
        if not isinstance(saved, Mapping) or set(saved) != set(template):
            raise misfit(f"a tree like params (keys {sorted(template)})")
        return {
            key: _rebuild(value, saved[key], f"{path}[{key!r}]", optimizer) for key, value in template.items()
        }
    if isinstance(template, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(template):
            raise misfit(f"a tree like params ({len(template)} items)")
        items = [
            _rebuild(value, item, f"{path}[{i}]", optimizer)
            for i, (value, item) in enumerate(zip(template, saved, strict=True))
        ]
        return type(template)(*items) if hasattr(template, "_fields") else type(template)(items)
    if type(saved) is not type(template):
        raise misfit(type(template).__name__)
    return saved
