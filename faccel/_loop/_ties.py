"""Tied tensors: one tensor several modules own, the owner it was tied from, FSDP2 units that keep it whole.

``self.head.weight = self.embed.weight`` leaves one Parameter that two modules
own. A built model records *that* they share it, not which way the assignment
went: the tie in the other direction (``self.embed.weight = self.head.weight``)
gives the same model. The eager build's values are the draw of the owner the
tensor was tied *from*, so a meta build reads that from the model's
``_tied_weights_keys`` (``{tied name: the name it is tied from}``, the mapping
Hugging Face models carry) when one says it.

FSDP2 shards each unit's parameters on their own: a tensor two units own
would be sharded twice, each unit training its own copy (and ``prepare``
tripping over the count of parameters). So a tied parameter's owners must
share one unit: the default policy leaves the units that would split a tie to
the unit around them; a policy the user chose is refused by name instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from faccel._torch_compat import module_dicts
from faccel.errors import PrepareError

__all__ = [
    "Owner",
    "check_ties_in_plan",
    "check_ties_in_units",
    "declared_sources",
    "full_name",
    "owners",
    "ties_in_one_unit",
]

# (path of the owning module, the module, 'parameter' or 'buffer', the tensor's name in it)
Owner = tuple[str, nn.Module, str, str]


def owners(model: nn.Module) -> dict[int, list[Owner]]:
    """Every tensor of ``model`` (by ``id``) with its owners, in ``named_modules()`` order.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Embedding(3, 2), torch.nn.Linear(2, 3, bias=False))
        >>> net[1].weight = net[0].weight
        >>> [[(path, name) for path, _, _, name in group] for group in owners(net).values()]
        [[('0', 'weight'), ('1', 'weight')]]
    """
    out: dict[int, list[Owner]] = {}
    for path, module in model.named_modules():
        _, params, buffers = module_dicts(module)
        for kind, tensors in (("parameter", params), ("buffer", buffers)):
            for name, tensor in tensors.items():
                if tensor is not None:
                    out.setdefault(id(tensor), []).append((path, module, kind, name))
    return out


def full_name(path: str, name: str) -> str:
    """``path.name``, or ``name`` for the root module's own tensors."""
    return f"{path}.{name}" if path else name


def declared_sources(model: nn.Module) -> dict[str, str]:
    """``{tied name: the name it is tied from}``, from every module's ``_tied_weights_keys`` mapping.

    The names are the model's (a submodule's keys get its path in front). A
    list (older Hugging Face models: the tied names only) says no source, and
    is not read.

    Example:
        >>> import torch
        >>> class Tied(torch.nn.Module):
        ...     _tied_weights_keys = {"head.weight": "embed.weight"}
        >>> declared_sources(torch.nn.Sequential(Tied()))
        {'0.head.weight': '0.embed.weight'}
    """
    out: dict[str, str] = {}
    for path, module in model.named_modules():
        keys: Any = module.__dict__.get(
            "_tied_weights_keys", getattr(type(module), "_tied_weights_keys", None)
        )
        if isinstance(keys, Mapping):
            for target, source in keys.items():
                if isinstance(target, str) and isinstance(source, str):
                    out[full_name(path, target)] = full_name(path, source)
    return out


def _param_groups(model: nn.Module) -> list[list[str]]:
    """The owner paths of each parameter that more than one module owns."""
    groups = []
    for group in owners(model).values():
        paths = list(dict.fromkeys(path for path, _, kind, _ in group if kind == "parameter"))
        if len(paths) > 1:
            groups.append(paths)
    return groups


def _unit_of(path: str, units: set[str]) -> str:
    """The innermost unit (a module path; ``''`` the root) that holds the module at ``path``."""
    while path and path not in units:
        path = path.rpartition(".")[0]
    return path


def ties_in_one_unit(model: nn.Module, policy: Callable[[nn.Module], bool]) -> Callable[[nn.Module], bool]:
    """``policy`` less the units that would split a tied parameter: the unit around them holds it.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Embedding(3, 2), torch.nn.Linear(2, 3, bias=False))
        >>> net[1].weight = net[0].weight
        >>> kept = ties_in_one_unit(net, lambda module: module is not net)
        >>> kept(net[0]), kept(net[1])
        (False, False)
    """
    units = {path for path, module in model.named_modules() if path and policy(module)}
    groups = _param_groups(model)
    split = True
    while split:
        split = False
        for paths in groups:
            holders = {_unit_of(path, units) for path in paths}
            if len(holders) > 1:
                units -= holders
                split = True
    chosen = {id(module) for path, module in model.named_modules() if path in units}
    return lambda module: id(module) in chosen


def check_ties_in_units(model: nn.Module, policy: Callable[[nn.Module], bool]) -> None:
    """Refuse a ``shard_policy`` that puts the owners of a tied parameter in different FSDP2 units.

    Raises:
        PrepareError: A parameter two modules own would be sharded by two units.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Embedding(3, 2), torch.nn.Linear(2, 3, bias=False))
        >>> net[1].weight = net[0].weight
        >>> check_ties_in_units(net, lambda module: False)
        >>> check_ties_in_units(net, lambda module: module is not net)
        Traceback (most recent call last):
        ...
        faccel.errors.PrepareError: shard_policy puts the tied parameter '0.weight' ...
    """
    units = {path for path, module in model.named_modules() if path and policy(module)}
    for group in owners(model).values():
        params = [(path, name) for path, _, kind, name in group if kind == "parameter"]
        holders = list(dict.fromkeys(_unit_of(path, units) for path, _ in params))
        if len(holders) > 1:
            names = ", ".join(full_name(path, name) for path, name in params)
            where = " and ".join(repr(unit or "<root>") for unit in holders)
            msg = (
                f"shard_policy puts the tied parameter {full_name(*params[0])!r} (one tensor: {names}) "
                f"in different FSDP2 units ({where}): each unit would shard and train its own copy; "
                "make shard_policy return False for the modules that own it (the unit around them, "
                "or the root, then holds it once), or True for one module that holds every owner"
            )
            raise PrepareError(msg)


def check_ties_in_plan(
    model: nn.Module, plan: Mapping[str, Any], matches: Callable[[str, str], bool]
) -> None:
    """Refuse a ``tp_plan`` key that splits a module owning a tied parameter (``matches(key, path)``).

    ``parallelize_module`` gives each module it splits DTensor parameters of its
    own, so an owner it splits no longer shares the tensor with the others.

    Raises:
        PrepareError: A plan key names an owner of a tied parameter.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Embedding(3, 2), torch.nn.Linear(2, 3, bias=False))
        >>> net[1].weight = net[0].weight
        >>> check_ties_in_plan(net, {"1": None}, lambda key, path: key == path)
        Traceback (most recent call last):
        ...
        faccel.errors.PrepareError: tp_plan key '1' splits 1, which owns the tied parameter '0.weight' ...
    """
    for group in owners(model).values():
        params = [(path, name) for path, _, kind, name in group if kind == "parameter"]
        if len({path for path, _ in params}) < 2:
            continue
        for path, _ in params:
            key = next((key for key in plan if matches(key, path)), None)
            if key is not None:
                names = ", ".join(full_name(p, n) for p, n in params)
                msg = (
                    f"tp_plan key {key!r} splits {path}, which owns the tied parameter "
                    f"{full_name(*params[0])!r} (one tensor: {names}); tensor parallelism gives each "
                    "module it splits parameters of its own, so the tie would come apart into two "
                    "tensors; leave the tied modules out of the plan (FSDP2 still shards them over "
                    "the data-parallel ranks), or untie them"
                )
                raise PrepareError(msg)
