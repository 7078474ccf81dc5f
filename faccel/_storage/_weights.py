"""A model's state dict as safetensors holds it: tied weights stored once, and checked on load.

Tied weights (two names, one tensor) are stored once, under the first name;
:func:`model_tensors` says which tensors to store and which names alias them.
:func:`compare_tensors` lists what stops saved tensors from loading into a
model, a name the model ties to a saved one counting as present. Checkpoints
and the Hugging Face weights export both store a model this way.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from faccel._torch_compat import is_dtensor
from faccel.errors import CheckpointError

__all__ = ["alias_groups", "compare_tensors", "model_tensors"]


def alias_groups(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Names that are the same tensor as an earlier name: ``{later: first}``.

    "The same tensor" means same memory, dtype, shape and strides (tied
    weights). Tensors that merely overlap are stored separately.

    Example:
        >>> import torch
        >>> w = torch.ones(2, 2)
        >>> alias_groups({"a": w, "b": torch.zeros(2), "c": w})
        {'c': 'a'}
    """
    seen: dict[tuple[object, ...], str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state.items():
        local = getattr(tensor, "to_local", None)
        if local is not None:  # an FSDP2 DTensor: its storage is the local shard's
            tensor = local()
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        identity = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tensor.dtype,
            tuple(tensor.shape),
            tensor.stride(),
        )
        if identity in seen:
            aliases[name] = seen[identity]
        else:
            seen[identity] = name
    return aliases


def model_tensors(
    model: nn.Module, whole: Mapping[str, torch.Tensor] | None = None, *, shards: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """An unwrapped model's tensors to store (each once) and its aliases ``{later: first}``.

    ``model`` is the user's own module (callers unwrap it: storage sits below the
    wrappers and never imports them).

    ``whole``: the gathered state dict of an FSDP2 model, or with ``shards``
    its sharded one (DTensors, for the sharded format; see ``_checkpoint._strategies._fsdp``).
    """
    state = dict(model.state_dict()) if whole is None else dict(whole)
    sharded = [name for name, tensor in state.items() if is_dtensor(tensor)]
    if sharded and not shards:
        msg = (
            f"the model's tensors are sharded (DTensor: {sharded[:3]}...) but were not gathered; "
            "prepare FSDP2 models with faccel.prepare (strategy='fsdp') so faccel recognises them"
        )
        raise CheckpointError(msg)
    aliases = alias_groups(state)
    stored = {name: tensor for name, tensor in state.items() if name not in aliases}
    return stored, aliases


def compare_tensors(
    saved: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    target: Mapping[str, torch.Tensor],
    *,
    strict: bool,
) -> tuple[list[str], list[str], list[str]]:
    """``(missing, unexpected, problems)`` of loading tensors of ``saved`` specs into ``target``.

    A target name missing from ``saved`` is not missing when the target ties
    it to a name that ``saved`` has. ``problems`` lists shape and dtype
    mismatches, and, when ``strict``, missing and unexpected names too.

    Example:
        >>> import torch
        >>> compare_tensors({"w": (torch.float32, (2,))}, {"w": torch.zeros(3)}, strict=True)
        ([], [], ["'w' has shape [2] in the file, [3] in the model"])
    """
    aliases = alias_groups(target)
    members: dict[str, list[str]] = {}
    for name in target:
        members.setdefault(aliases.get(name, name), []).append(name)
    missing: list[str] = []
    problems: list[str] = []
    for name, tensor in target.items():
        tied = members[aliases.get(name, name)]
        found = next((other for other in [name, *tied] if other in saved), None)
        if found is None:
            missing.append(name)
            continue
        dtype, shape = saved[found]
        if tuple(tensor.shape) != shape:
            problems.append(
                f"{found!r} has shape {list(shape)} in the file, {list(tensor.shape)} in the model"
            )
        if tensor.dtype != dtype:
            problems.append(f"{found!r} has dtype {dtype} in the file, {tensor.dtype} in the model")
    unexpected = [name for name in saved if name not in target]
    if strict:
        problems += [f"missing {name!r}" for name in missing]
        problems += [f"unexpected {name!r}" for name in unexpected]
    return missing, unexpected, problems
