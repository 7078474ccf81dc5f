"""A model built with no storage, and what a memory plan reads of it: shapes, units, activations.

:func:`build_model` calls the user's function in a fake-tensor context (CPU
tensors with no storage; on meta when the constructor reads values);
:func:`param_specs` reads each parameter's shape, dtype, tensor-parallel dim
and FSDP2 unit; :func:`activation_bytes` counts what one forward saves for
backward, on those storage-less tensors. Nothing is allocated.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from faccel._loop._strategies._mesh._tp_plan import plan_key_matches
from faccel._report._memory_arith import ParamSpec
from faccel._torch_compat import fake_tensors, view_base
from faccel.errors import ArgumentError, ArgumentValueError

__all__ = ["activation_bytes", "build_model", "param_specs"]


# ParallelStyle -> (the dim it splits of an nn.Linear's weight, of its bias, of an nn.Embedding's weight).
_STYLE_DIMS: Mapping[str, tuple[int | None, int | None, int | None]] = {
    "ColwiseParallel": (0, 0, 1),
    "RowwiseParallel": (1, None, 0),
}


def _tensor_dims(model: nn.Module, tp_plan: Mapping[str, Any] | None) -> dict[str, int]:
    """Parameter name -> the dim ``tp_plan`` splits (Colwise/Rowwise on ``nn.Linear``, ``nn.Embedding``)."""
    dims: dict[str, int] = {}
    for path, module in model.named_modules():
        style = next(
            (s for key, s in (tp_plan or {}).items() if path and plan_key_matches(key, path)),
            None,
        )
        rule = _STYLE_DIMS.get(type(style).__name__) if style is not None else None
        if rule is None:
            continue
        weight_dim, bias_dim, embedding_dim = rule
        for name, dim in (
            ("weight", embedding_dim if isinstance(module, nn.Embedding) else weight_dim),
            ("bias", bias_dim),
        ):
            if dim is not None and getattr(module, name, None) is not None:
                dims[f"{path}.{name}"] = dim
    return dims


def _units(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the FSDP2 unit that owns it under faccel's default policy (innermost unit)."""
    from faccel._loop._model import default_shard_policy

    policy = default_shard_policy(model)
    paths = [path for path, module in model.named_modules() if path and policy(module)]
    out = {}
    for name, _ in model.named_parameters():
        owners = [p for p in paths if name.startswith(p + ".")]
        out[name] = max(owners, key=len, default="")
    return out


def param_specs(model: nn.Module, tp_plan: Mapping[str, Any] | None = None) -> list[ParamSpec]:
    """``model``'s parameters (tied ones once) as :class:`ParamSpec` records; reads shapes only.

    Example:
        >>> with torch.device("meta"):
        ...     net = torch.nn.Linear(3, 2)
        >>> [(s.name, s.shape, s.itemsize) for s in param_specs(net)]
        [('weight', (2, 3), 4), ('bias', (2,), 4)]
    """
    dims = _tensor_dims(model, tp_plan)
    units = _units(model)
    return [
        ParamSpec(
            name=name,
            shape=tuple(param.shape),
            itemsize=param.element_size(),
            tensor_dim=dims.get(name),
            trainable=param.requires_grad,
            unit=units[name],
        )
        for name, param in model.named_parameters()
    ]


def activation_bytes(model: nn.Module, inputs: Any, fake: Any = None) -> int:
    """Bytes of the tensors one forward of ``model`` on ``inputs`` saves for backward; nothing allocated.

    ``inputs`` is a tuple of positional arguments or a mapping of keyword
    arguments. ``model`` is on meta, or was built in ``fake`` (a
    ``faccel._torch_compat.fake_tensors()`` context, as :func:`estimate_memory`
    builds a model from its function). On meta, the inputs are moved to meta
    and attention runs as SDPA's math kernel (the one the meta device has),
    which saves the softmax. With ``fake``, the inputs become fake CPU tensors
    of their shapes and dtypes, and every op dispatches as on the CPU: the
    count is a real CPU forward's, byte for byte.

    Each saved storage counts once (a view counts its base); the parameters a
    layer saves are not activations and are left out. Counted with
    ``torch.autograd.graph.saved_tensors_hooks``: what a forward holds until
    its backward, which dominates the activation memory of a step.

    Example:
        >>> with torch.device("meta"):
        ...     net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> activation_bytes(net, (torch.zeros(3, 8),))  # the input, the ReLU's output (saved twice)
        288
    """
    params = {id(p) for p in model.parameters()}
    seen: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        root = view_base(tensor)
        if id(tensor) not in params and id(root) not in params:
            seen.setdefault(id(root), root)
        return tensor

    def moved(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if fake is None:
            return value.to("meta")
        return torch.zeros(value.shape, dtype=value.dtype)  # in the fake mode: a shape, no storage

    with contextlib.ExitStack() as stack:
        if fake is not None:
            stack.enter_context(fake)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor))
        stack.enter_context(torch.enable_grad())
        if isinstance(inputs, Mapping):
            model(**{key: moved(value) for key, value in inputs.items()})
        else:
            model(*(moved(value) for value in inputs))
    return sum(t.numel() * t.element_size() for t in seen.values())


def build_model(model: nn.Module | Callable[[], nn.Module] | str) -> tuple[nn.Module, Any]:
    """The model, and the fake-tensor context it was built in (None: built on meta, or given)."""
    if isinstance(model, nn.Module):
        return model, None
    if isinstance(model, str):
        module_name, _, function = model.partition(":")
        if not module_name or not function:
            msg = f"a model is named 'module:function' (a function that builds it), got {model!r}"
            raise ArgumentValueError(msg)
        model = getattr(importlib.import_module(module_name), function)
    if not callable(model):
        msg = f"model must be an nn.Module, a callable that builds one or 'module:function', got {model!r}"
        raise ArgumentError(msg)
    fake = fake_tensors()
    try:
        with fake:  # a CPU model with no storage: its forward dispatches as on the CPU
            built = model()
    except Exception:  # a constructor that reads values (.item()): build on meta instead
        fake = None
        with torch.device("meta"):
            built = model()
    if not isinstance(built, nn.Module):
        msg = f"the model function returned a {type(built).__name__}, not an nn.Module"
        raise ArgumentError(msg)
    return built, fake
