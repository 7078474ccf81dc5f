"""Calling a module with given tensors in its parameter and buffer slots, fast.

``torch.func.functional_call`` works out, on every call, which names are tied,
where each name lives (walking the module tree) and checks every name and
tensor before swapping them in: about 38 us per call for a four-layer MLP,
as much as that MLP's forward (measured here, torch 2.13, one thread). A
training loop calls the same module with the same names every step, so a
:class:`ModuleCaller` does that work once (:func:`bind`) and each call only
checks, swaps the tensors in, runs the module and swaps the originals back.

It stays exact by checking, per call, everything :func:`bind` relied on:
the given names are all bound ones and tensors, every submodule still sits
where it sat (``model.fc = nn.Linear(...)``), no parameter or buffer slot was
added or removed, and the slots still share tensors as they did (weights tied
or untied since, ``head.weight = emb.weight``, change which slots a name
feeds). A slot given a new tensor of its own (a forward that reassigns a
buffer) changes nothing: tensors are swapped in by slot, not by identity.
When the module changed, it binds again; names it does not know go to
``functional_call`` itself, which gives torch's own answer or error.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from faccel._torch_compat import module_dicts

__all__ = ["Bound", "ModuleCaller", "bind"]

# (the dict a tensor lives in: a module's _parameters or _buffers, its key there)
_Slot = tuple[dict[str, Any], str]
_MISSING: Any = object()  # a key no longer there, told apart from a key holding None


class Bound(NamedTuple):
    """Where each name's tensor goes in one module, as it was; made by :func:`bind`.

    A NamedTuple, not an attrs record: it is read on every training step.
    """

    # (parent._modules, child's name, child) for every submodule entry, None ones too
    # (register_module("head", None), filled later): all must still hold.
    links: tuple[tuple[dict[str, Any], str, nn.Module | None], ...]
    # Every module's _modules, _parameters and _buffers, and each one's length then:
    # a slot or submodule added or removed changes one.
    dicts: tuple[dict[str, Any], ...]
    sizes: tuple[int, ...]
    # Every key of every _parameters and _buffers dict (None-valued ones too: Linear(bias=False)
    # keeps "bias": None), and which of them shared a tensor (see _sharing).
    slots: tuple[_Slot, ...]
    sharing: tuple[int, ...]
    # Canonical name -> every slot that shares its tensor (tied weights get them all).
    params: dict[str, tuple[_Slot, ...]]
    buffers: dict[str, tuple[_Slot, ...]]


def _slots(module: nn.Module, named: dict[str, Any], store: int) -> dict[str, tuple[_Slot, ...]]:
    """Canonical name -> slots; the canonical name is the first, as ``named_parameters()`` gives.

    ``store``: 1 for parameters, 2 for buffers (the place in :func:`module_dicts`).
    """
    by_tensor: dict[int, list[_Slot]] = {}
    canonical: dict[str, list[_Slot]] = {}
    for name, tensor in named.items():
        owner, _, attr = name.rpartition(".")
        slot = (module_dicts(module.get_submodule(owner))[store], attr)
        if id(tensor) in by_tensor:
            by_tensor[id(tensor)].append(slot)
        else:
            by_tensor[id(tensor)] = canonical[name] = [slot]
    return {name: tuple(slots) for name, slots in canonical.items()}


def bind(module: nn.Module) -> Bound | None:
    """The slots of ``module``'s parameters and buffers; None when only ``functional_call`` will do.

    None for lazy modules (their parameters do not exist yet), scripted ones
    and ``nn.DataParallel`` (``functional_call`` refuses both), and a module
    with a tensor registered as a parameter and as a buffer too
    (``functional_call`` ties those across the two dicts).

    Example:
        >>> import torch
        >>> from faccel._func._module_call import bind
        >>> bound = bind(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        >>> sorted(bound.params), len(bound.links), bound.sharing
        (['0.bias', '0.weight'], 1, (0, 1))
    """
    if isinstance(module, torch.jit.ScriptModule | nn.DataParallel):
        return None
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    if any(nn.parameter.is_lazy(p) for p in params.values()):
        return None
    if {id(t) for t in params.values()} & {id(t) for t in buffers.values()}:
        return None
    owned = [module_dicts(m) for m in module.modules()]  # (_modules, _parameters, _buffers) each
    links = tuple((children, name, child) for children, _, _ in owned for name, child in children.items())
    dicts = tuple(d for triple in owned for d in triple)
    slots = tuple(
        (store, key) for _, params_, buffers_ in owned for store in (params_, buffers_) for key in store
    )
    return Bound(
        links=links,
        dicts=dicts,
        sizes=tuple(map(len, dicts)),
        slots=slots,
        sharing=_sharing(slots),
        params=_slots(module, params, 1),
        buffers=_slots(module, buffers, 2),
    )


def _sharing(slots: tuple[_Slot, ...]) -> tuple[int, ...]:
    """For each slot, the first slot holding the same tensor (itself if none).

    ``-1 - i`` marks a slot holding None, ``-1 - i - len(slots)`` one whose key is gone.
    Which slots share a tensor, not which tensors they hold: a slot given a new tensor of
    its own keeps the pattern, a tie made or broken changes it.
    """
    first: dict[int, int] = {}
    pattern = []
    for i, (store, key) in enumerate(slots):
        value = store.get(key, _MISSING)
        if value is _MISSING:
            pattern.append(-1 - i - len(slots))
        elif value is None:
            pattern.append(-1 - i)
        else:
            pattern.append(first.setdefault(id(value), i))
    return tuple(pattern)


def _current(bound: Bound) -> bool:
    """Whether the module is still as :func:`bind` saw it: same submodules, slots and ties."""
    return (
        all(parent.get(name, _MISSING) is child for parent, name, child in bound.links)
        and tuple(map(len, bound.dicts)) == bound.sizes
        and _sharing(bound.slots) == bound.sharing
    )


class ModuleCaller:
    """``functional_call(module, (params, buffers), args)`` for one module, its bookkeeping done once.

    ``args``: one argument or a tuple of positional arguments. A name left
    out of ``params`` or ``buffers`` keeps the module's own tensor, as in
    ``functional_call``. Like ``functional_call``, it puts the given tensors
    into the module while it runs: one thread at a time per module.

    Example:
        >>> import torch
        >>> from faccel._func._module_call import ModuleCaller
        >>> layer = torch.nn.Linear(1, 1, bias=False)
        >>> ModuleCaller(layer)({"weight": torch.full((1, 1), 3.0)}, {}, torch.ones(1, 1)).item()
        3.0
    """

    __slots__ = ("_bound", "module")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._bound = bind(module)

    def __call__(self, params: dict[str, Any], buffers: dict[str, Any], args: Any) -> Any:
        bound = self._bound
        if bound is not None and not _current(bound):
            # The module changed since bind (a submodule or slot added or replaced, weights
            # tied or untied): bind again, a cache refresh, rather than swap into stale slots.
            bound = self._bound = bind(self.module)
        if bound is None or not (
            params.keys() <= bound.params.keys() and buffers.keys() <= bound.buffers.keys()
        ):
            return self._functional_call(params, buffers, args)
        swapped: list[tuple[dict[str, Any], str, Any]] = []
        for slots_of, values in ((bound.params, params), (bound.buffers, buffers)):
            for name, value in values.items():
                if not isinstance(value, torch.Tensor):
                    _restore(swapped)  # functional_call says what is wrong with it
                    return self._functional_call(params, buffers, args)
                for store, attr in slots_of[name]:
                    swapped.append((store, attr, store[attr]))
                    store[attr] = value
        try:
            return self.module(*(args if isinstance(args, tuple) else (args,)))
        finally:
            _restore(swapped)

    def _functional_call(self, params: dict[str, Any], buffers: dict[str, Any], args: Any) -> Any:
        return torch.func.functional_call(self.module, (params, buffers) if buffers else params, args)


def _restore(swapped: list[tuple[dict[str, Any], str, Any]]) -> None:
    # Backwards, so a slot swapped twice (a submodule reachable under two names) ends as it began.
    for store, attr, old in reversed(swapped):
        store[attr] = old
