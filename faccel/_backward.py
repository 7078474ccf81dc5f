"""``backward``: the loss's backward pass, with the scaling precision and accumulation need."""

from __future__ import annotations

from typing import Any

import torch

from faccel._accumulate import MicroStep
from faccel._state import DistState
from faccel.errors import AccumulationError, ArgumentError, ArgumentValueError, PrecisionError

__all__ = ["backward"]


def backward(
    dist: DistState,
    loss: torch.Tensor = None,  # type: ignore[assignment]  # backward(loss) gets a named error
    *,
    micro: MicroStep | None = None,
    scaler: torch.amp.GradScaler | None = None,
    **kwargs: Any,
) -> None:
    """Run the backward pass of ``loss`` as ``dist`` requires.

    * Accumulation: with ``micro``, the loss is divided by the micro-step's
      group size, so the accumulated gradient is the mean over the group
      (the last, partial group of an epoch included).
    * fp16: with an active ``scaler`` the loss is scaled before backward.
    * DDP averages gradients across ranks during this call (its own hooks),
      except inside ``faccel.accumulate`` on a non-syncing micro-step.
    * Under ``strategy='deepspeed'``: the engine's backward, with the
      micro-step's ``sync`` as its accumulation boundary; DeepSpeed scales
      fp16 losses itself (no ``scaler``).

    Args:
        dist: The run's :class:`DistState`.
        loss: A scalar tensor.
        micro: The :class:`MicroStep` of this micro-batch; required when
            ``dist.accumulation_steps > 1``.
        scaler: The gradient scaler from :func:`grad_scaler`; required under fp16.
        **kwargs: Passed to ``torch.Tensor.backward`` (``retain_graph``...).

    Raises:
        ArgumentError: ``loss`` is not a tensor, or ``dist`` is missing
            (``backward(loss)``).
        ArgumentValueError: ``loss`` is not a scalar (reduce it, e.g. ``.mean()``).
        AccumulationError: Accumulation without ``micro``.
        PrecisionError: fp16 without ``scaler``.

    Example:
        >>> import torch, faccel
        >>> w = torch.ones(2, requires_grad=True)
        >>> faccel.backward(faccel.detect({}), (w * 3).sum())
        >>> w.grad.tolist()
        [3.0, 3.0]
    """
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        _refuse(dist, loss)
    if micro is not None:
        if micro.group_size != 1:
            loss = loss / micro.group_size
    elif dist.accumulation_steps != 1:
        msg = (
            f"accumulation_steps is {dist.accumulation_steps} but backward() got no micro-step, so "
            "it cannot scale the loss; iterate faccel.micro_batches(dist, loader) and pass micro="
        )
        raise AccumulationError(msg)
    if dist.strategy == "deepspeed":  # the engine's backward: its reductions, its fp16 loss scale
        from faccel._deepspeed import engine_backward

        engine_backward(loss, sync=micro is None or micro.sync, **kwargs)
        return
    if scaler is not None and scaler.is_enabled():
        loss = scaler.scale(loss)
    elif dist.precision == "fp16":
        msg = (
            "fp16 training needs loss scaling: create scaler = faccel.grad_scaler(dist) once and "
            "pass scaler= to faccel.backward and faccel.optimizer_step"
        )
        raise PrecisionError(msg)
    loss.backward(**kwargs)


def _refuse(dist: Any, loss: Any) -> None:
    """Raise the error that names the fix for a loss ``backward`` cannot take."""
    if isinstance(dist, torch.Tensor):
        msg = "backward() got a tensor where the DistState goes; call faccel.backward(dist, loss)"
        raise ArgumentError(msg)
    if not isinstance(loss, torch.Tensor):
        msg = (
            f"backward() needs the loss as a scalar torch.Tensor, got {type(loss).__name__}; "
            "pass the tensor itself, not loss.item()"
        )
        raise ArgumentError(msg)
    msg = (
        f"backward() needs a scalar loss, got shape {list(loss.shape)}; reduce it first "
        "(loss.mean() or loss.sum(), or reduction='mean' in the loss function)"
    )
    raise ArgumentValueError(msg)
