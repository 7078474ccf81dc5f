"""The floor of model wrapping: the autocast layer, the layers every strategy may meet, sharded models.

The user's module's methods are never replaced: precision comes from a thin
outer module whose forward runs the user's forward under autocast, and a
strategy's wrapper (DDP) wraps that. :func:`peel` takes off torch's layers
and this one; each strategy (``faccel._loop._strategies``) wraps and
unwraps its own. The marks a prepared module gets (the wrapper it got,
whether faccel split it for tensor parallelism, a DDP wrapper's pinned process
group, the evaluation check-in hook of a sharded model) are listed with why
in ``faccel._marks``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from faccel._marks import TENSOR_PARALLEL
from faccel._torch_compat import compiled_original
from faccel._tree import map_tensors

__all__ = ["Autocast", "float32_outputs", "is_sharded", "peel"]


def float32_outputs(tree: Any) -> Any:
    """``tree`` with its float16 and bfloat16 tensors cast to float32 (outputs of an autocast forward)."""
    return map_tensors(_float32, tree)


def _float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


class Autocast(nn.Module):
    """Runs ``module``'s forward under ``torch.autocast`` and returns float32 outputs.

    Float32 outputs keep the loss, computed outside the model, in full
    precision, as with hand-written autocast code.
    """

    def __init__(self, module: nn.Module, *, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            out = self.module(*args, **kwargs)
        return float32_outputs(out)


# Layers that wrap a module and keep it in an attribute: peeled by peel (DDP's is torch's own class).
_WRAPPERS: tuple[tuple[type, str], ...] = (
    (DistributedDataParallel, "module"),
    (Autocast, "module"),
)


def peel(model: nn.Module) -> nn.Module:
    """The module inside the layers of torch and of the floor: DDP, autocast, ``torch.compile``.

    A strategy's own layer (a DeepSpeed engine) is the strategy's to take off:
    :func:`faccel.unwrap_model` (``faccel._loop._strategies``) peels every layer.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(2, 1)
        >>> peel(Autocast(net, device_type="cpu", dtype=torch.bfloat16)) is net
        True
    """
    while True:
        for kind, attribute in _WRAPPERS:
            if isinstance(model, kind):
                model = getattr(model, attribute)
                break
        else:
            original = compiled_original(model)  # torch.compile's OptimizedModule
            if original is None:
                return model
            model = original


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors faccel made: FSDP2's ``fully_shard`` or tensor parallelism.

    Such a model is saved and restored through the whole-state collectives,
    not its own ``state_dict`` (which holds each rank's pieces).
    """
    # Looked up on the class: Module.__getattr__ would build an error message per miss.
    kind = type(model)
    return (hasattr(kind, "set_requires_gradient_sync") and hasattr(kind, "reshard")) or (
        _TENSOR_PARALLEL in model.__dict__
    )


# Set on a module whose layers faccel split over the "tensor" dimension without FSDP2
# (tensor parallelism alone): its parameters are DTensors all the same. See faccel._marks.
_TENSOR_PARALLEL = TENSOR_PARALLEL
