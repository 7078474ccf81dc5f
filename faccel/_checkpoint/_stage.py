"""Each ``load_state_dict`` of a restore, tried first on a throwaway copy of its object.

Checks of keys, classes, shapes and dtypes cannot foresee everything an
object's ``load_state_dict`` refuses (a SequentialLR with fewer schedulers,
an optimizer's groups split otherwise, a step that is not a number). So
:func:`load_problem` loads the saved state into a throwaway copy of the object and
reports what it raised; the live object is loaded only once every copy took
its state.

The copy is exact in structure and cheap in memory: ``copy.deepcopy`` with
every tensor the TrainState's objects reach (the model's parameters and
buffers, each optimizer's parameters and state) replaced by a ``meta``
tensor of its shape and dtype, which holds no data. The copy of a scheduler
copies the optimizer it steers the same way: no live object is reachable
from a copy, so nothing a copy's ``load_state_dict`` does can change one.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from faccel._tree import flatten_with_paths, map_tensors

__all__ = ["load_problem", "stand_ins"]


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A data-less tensor of ``tensor``'s shape and dtype (a Parameter for a Parameter)."""
    empty = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(empty, requires_grad=tensor.requires_grad)
    return empty


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors ``obj``'s state reaches: what throwaway copies replace by stand-ins."""
    found: list[Any] = []
    if isinstance(obj, nn.Module):
        found += [tensor for _, tensor in obj.named_parameters()]
        found += [tensor for _, tensor in obj.named_buffers()]
        state: Any = obj.state_dict(keep_vars=True)
    elif isinstance(obj, torch.optim.Optimizer):
        found += [param for group in obj.param_groups for param in group["params"]]
        state = list(obj.state.values())
    else:
        state = obj.state_dict()
    found += flatten_with_paths(state)[0]
    return [tensor for tensor in found if isinstance(tensor, torch.Tensor)]


def stand_ins(objects: Iterable[Any]) -> dict[int, Any]:
    """A ``meta`` stand-in for every tensor the states of ``objects`` reach, by ``id``.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> stand_ins([model])[id(model.weight)].device.type
        'meta'
    """
    found: dict[int, Any] = {}
    for obj in objects:
        for tensor in _tensors(obj):
            if id(tensor) not in found:
                found[id(tensor)] = _stand_in(tensor)
    return found


def load_problem(obj: Any, saved: Any, stand_in: dict[int, Any]) -> str | None:
    """What ``obj.load_state_dict(saved)`` raises on a throwaway copy of ``obj``; None if it loads.

    The copy is ``copy.deepcopy(obj)`` with each tensor in ``stand_in`` (see
    :func:`stand_ins`; give it every object the copy may reach: the model, the
    optimizer a scheduler steers) replaced by its data-less stand-in, so no
    live object or tensor is touched and no tensor data is copied. An object
    that cannot be copied is not tried (None); its own ``load_state_dict``
    then runs on the live object, and restore turns what it raises into a
    CheckpointError all the same.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> load_problem(model, torch.nn.Linear(2, 1).state_dict(), stand_ins([model])) is None
        True
        >>> print(load_problem(model, {}, stand_ins([model])))  # doctest: +ELLIPSIS
        RuntimeError: Error(s) in loading state_dict for Linear: Missing key(s) ...
    """
    try:
        copied = copy.deepcopy(obj, dict(stand_in))
    except Exception:  # not copyable (a lock, a file handle): nothing to try it on
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "copying into a meta parameter is a no-op": intended
            # Fresh containers: a load_state_dict that pops or updates keys works on its own copy.
            copied.load_state_dict(map_tensors(lambda tensor: tensor, saved))
    except Exception as error:  # any refusal: reported as the checkpoint not fitting
        text = " ".join(str(error).split())
        return f"{type(error).__name__}: {text[:300]}"
    return None
