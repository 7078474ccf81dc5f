"""Calling a module with given tensors in its parameter and buffer slots, fast.

``torch.func.functional_call`` works out, on every call, which names are tied,
where each name lives (walking the module tree) and checks every name and
tensor before swapping them in: about 38 us per call for a four-layer MLP,
as much as that MLP's forward (measured here, torch 2.13, one thread). A
training loop calls the same module with the same names every step, so
:func:`bind` does that work once and :func:`call` only swaps tensors in,
runs the module and swaps the originals back (~1.5 us).

It stays exact by checking, per call, what could have changed since
:func:`bind`: the given names must all be bound ones and every
submodule must still sit where it sat (``model.fc = nn.Linear(...)`` after
binding would otherwise have its new weights ignored). Anything else (other
names, a rebuilt tree, a removed parameter) goes to ``functional_call``
itself, which gives torch's own answer or error.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Bound", "bind", "call"]

# (the dict a tensor lives in: a module's _parameters or _buffers, its key there)
_Slot = tuple[dict[str, Any], str]


class Bound(NamedTuple):
    """Where each name's tensor goes in one module; made by :func:`bind`.

    A NamedTuple, not an attrs record: it is read on every training step.
    """

    # (parent._modules, child's name, child) for every submodule: all must still hold.
    links: tuple[tuple[dict[str, Any], str, nn.Module], ...]
    # Canonical name -> every slot that shares its tensor (tied weights get them all).
    params: dict[str, tuple[_Slot, ...]]
    buffers: dict[str, tuple[_Slot, ...]]


def _slots(module: nn.Module, named: Any, store: str) -> dict[str, tuple[_Slot, ...]]:
    """Canonical name -> slots; the canonical name is the first, as ``named_parameters()`` gives."""
    by_tensor: dict[int, list[_Slot]] = {}
    canonical: dict[str, list[_Slot]] = {}
    for name, tensor in named(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        slot = (getattr(module.get_submodule(owner), store), attr)
        if id(tensor) in by_tensor:
            by_tensor[id(tensor)].append(slot)
        else:
            by_tensor[id(tensor)] = canonical[name] = [slot]
    return {name: tuple(slots) for name, slots in canonical.items()}


def bind(module: nn.Module) -> Bound | None:
    """The slots of ``module``'s parameters and buffers; None when only ``functional_call`` will do.

    None for lazy modules (their parameters do not exist yet) and scripted ones.

    Example:
        >>> import torch
        >>> from faccel._module_call import bind
        >>> bound = bind(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        >>> sorted(bound.params), len(bound.links)
        (['0.bias', '0.weight'], 1)
    """
    if isinstance(module, torch.jit.ScriptModule):
        return None
    if any(nn.parameter.is_lazy(p) for p in module.parameters()):
        return None
    links = tuple(
        (parent._modules, name, child)
        for parent in module.modules()
        for name, child in parent._modules.items()
        if child is not None
    )
    return Bound(
        links=links,
        params=_slots(module, module.named_parameters, "_parameters"),
        buffers=_slots(module, module.named_buffers, "_buffers"),
    )


def _fits(bound: Bound, params: dict[str, Any], buffers: dict[str, Any]) -> bool:
    return (
        params.keys() <= bound.params.keys()
        and buffers.keys() <= bound.buffers.keys()
        and all(parent.get(name) is child for parent, name, child in bound.links)
    )


def call(
    bound: Bound | None, module: nn.Module, params: dict[str, Any], buffers: dict[str, Any], args: Any
) -> Any:
    """``functional_call(module, (params, buffers), args)``, through ``bound`` when it still fits.

    ``args``: one argument or a tuple of positional arguments. A name left
    out of ``params`` or ``buffers`` keeps the module's own tensor, as in
    ``functional_call``.

    Example:
        >>> import torch
        >>> from faccel._module_call import bind, call
        >>> layer = torch.nn.Linear(1, 1, bias=False)
        >>> call(bind(layer), layer, {"weight": torch.full((1, 1), 3.0)}, {}, torch.ones(1, 1)).item()
        3.0
    """
    if bound is None or not _fits(bound, params, buffers):
        return torch.func.functional_call(module, (params, buffers) if buffers else params, args)
    args = args if isinstance(args, tuple) else (args,)
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for slots_of, values in ((bound.params, params), (bound.buffers, buffers)):
            for name, value in values.items():
                for store, attr in slots_of[name]:
                    # KeyError here: a parameter was deleted since bind(); restored below.
                    swapped.append((store, attr, store[attr]))
                    store[attr] = value
    except KeyError:
        _restore(swapped)
        return torch.func.functional_call(module, (params, buffers) if buffers else params, args)
    try:
        return module(*args)
    finally:
        _restore(swapped)


def _restore(swapped: list[tuple[dict[str, Any], str, Any]]) -> None:
    # Backwards, so a slot swapped twice (never, by construction) would still end as it began.
    for store, attr, old in reversed(swapped):
        store[attr] = old
