"""Gradient clipping that knows about the fp16 scaler and wrapped models."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from faccel._dist._state import DistState
from faccel._loop._model import unwrap_model
from faccel._loop._strategies._deepspeed._engine import is_deepspeed_engine
from faccel._loop._strategies._pipeline._stages import PipelinedModel, clip_stages
from faccel._marks import DEEPSPEED_ENGINE
from faccel.errors import PrecisionError, UsageError

__all__ = ["clip_grad_norm", "clip_grad_value"]

Params = nn.Module | torch.Tensor | Iterable[torch.Tensor]


def _params(model_or_params: Params) -> list[torch.Tensor]:
    params: list[torch.Tensor]
    if isinstance(model_or_params, nn.Module):
        params = list(unwrap_model(model_or_params).parameters())
    elif isinstance(model_or_params, torch.Tensor):
        params = [model_or_params]
    else:
        params = list(model_or_params)
    if is_deepspeed_engine(model_or_params) or any(hasattr(p, DEEPSPEED_ENGINE) for p in params):
        # ZeRO reduces and partitions the gradients into its own buffers: clipping the parameters'
        # .grad would not change what the step uses, silently.
        msg = (
            "under strategy='deepspeed' the gradients the step uses lie in ZeRO's buffers, not in the "
            "parameters' .grad, and the engine clips them in its step: put the limit in the deepspeed "
            "config, faccel.detect(strategy='deepspeed', deepspeed={..., 'gradient_clipping': MAX_NORM}), "
            "and drop the clip call; model.get_global_grad_norm() gives the norm after optimizer.step()"
        )
        raise UsageError(msg)
    return params


def _unscale(scaler: torch.amp.GradScaler | None, optimizer: torch.optim.Optimizer | None) -> None:
    if scaler is None or not scaler.is_enabled():
        return
    if optimizer is None:
        msg = (
            "clipping fp16 gradients needs them unscaled first, and the scaler unscales per "
            "optimizer: pass optimizer= along with scaler="
        )
        raise PrecisionError(msg)
    scaler.unscale_(optimizer)


def clip_grad_norm(
    dist: DistState,
    model_or_params: Params,
    max_norm: float,
    *,
    norm_type: float = 2.0,
    scaler: torch.amp.GradScaler | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients' total norm to ``max_norm`` and return the norm before clipping.

    Call it after the backward of a syncing micro-step and before
    :func:`optimizer_step`. Under DDP the gradients are already averaged, so
    every rank computes the same norm; under FSDP2 and tensor parallelism the
    norm of the sharded (DTensor) gradients is reduced across ranks, mesh by
    mesh, and returned as a plain tensor, the same on every rank; under pipeline
    stages (a ``PipelinedModel``) the stages' norms are combined over the
    pipeline group, so every stage clips by the whole model's norm. With an active fp16 ``scaler`` the
    gradients of ``optimizer`` are unscaled first (once per step; the scaler
    remembers, and ``optimizer_step`` does not unscale again).

    Args:
        dist: The run's :class:`DistState`.
        model_or_params: A (prepared) model, a tensor, or an iterable of tensors.
        max_norm: The largest total norm allowed.
        norm_type: The p of the p-norm (``inf`` for the max norm).
        scaler: The fp16 gradient scaler, or None.
        optimizer: The optimizer whose gradients the scaler must unscale.
        error_if_nonfinite: Raise if the total norm is NaN or inf.
        foreach: As for ``torch.nn.utils.clip_grad_norm_``.

    Returns:
        The total norm of the gradients before clipping.

    Raises:
        PrecisionError: An active scaler without ``optimizer``.
        UsageError: A DeepSpeed engine's parameters (clip with the config's
            ``gradient_clipping``: docs/deepspeed.md).
        RuntimeError: ``error_if_nonfinite`` and a non-finite norm (torch's).

    Example:
        >>> import torch, faccel
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> w.grad = torch.tensor([3.0, 4.0])
        >>> faccel.clip_grad_norm(faccel.DistState(), [w], 1.0).item()
        5.0
        >>> [round(g, 4) for g in w.grad.tolist()]
        [0.6, 0.8]
    """
    _unscale(scaler, optimizer)
    params = _params(model_or_params)
    if isinstance(model_or_params, PipelinedModel):  # the norm over every stage of the pipeline
        return clip_stages(
            dist,
            params,
            max_norm,
            norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
        )
    by_mesh = _by_mesh(params)
    if len(by_mesh) > 1:
        return _clip_across_meshes(by_mesh, max_norm, norm_type, error_if_nonfinite, foreach)
    norm = torch.nn.utils.clip_grad_norm_(
        params,
        max_norm,
        norm_type=norm_type,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
    )
    # FSDP2: the norm of sharded (DTensor) gradients is a DTensor; hand back a plain one.
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm


def _by_mesh(params: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """Parameters with gradients, by the DeviceMesh of their gradient (None: a plain tensor)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            groups.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    return groups


def _clip_across_meshes(
    by_mesh: dict[Any, list[torch.Tensor]],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: bool | None,
) -> torch.Tensor:
    """Clip gradients that live on several meshes (tensor parallelism beside FSDP2) by one total norm.

    torch's ``clip_grad_norm_`` stacks every gradient's norm, which DTensors on
    different meshes refuse (a tensor-parallel weight on ``(shard, tensor)``,
    a LayerNorm on ``(shard,)``). Each mesh's norm is taken alone and made whole
    with ``full_tensor`` (an all-reduce over that mesh's ranks); the total of
    those whole norms is the same number on every rank.
    """
    norms = []
    for group in by_mesh.values():
        grads = [p.grad for p in group if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
        full = getattr(norm, "full_tensor", None)
        norms.append((full() if full is not None else norm).float().cpu())
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        msg = f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()})"
        raise RuntimeError(msg)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total


def clip_grad_value(
    dist: DistState,
    model_or_params: Params,
    clip_value: float,
    *,
    scaler: torch.amp.GradScaler | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` (in place).

    Example:
        >>> import torch, faccel
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> w.grad = torch.tensor([3.0, -0.5])
        >>> faccel.clip_grad_value(faccel.DistState(), [w], 1.0)
        >>> w.grad.tolist()
        [1.0, -0.5]
    """
    _unscale(scaler, optimizer)
    torch.nn.utils.clip_grad_value_(_params(model_or_params), clip_value)
