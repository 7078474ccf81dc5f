"""``backward``: the loss's backward pass, with the scaling precision and accumulation need."""

from __future__ import annotations

from typing import Any

import torch

from faccel._dist._state import DistState
from faccel._loop._micro_step import MicroStep
from faccel.errors import AccumulationError, ArgumentError, ArgumentValueError, PrecisionError

__all__ = ["backward"]


def backward(
    dist: DistState,
    loss: torch.Tensor = None,  # type: ignore[assignment]  # backward(loss) gets a named error
    *,
    micro: MicroStep | None = None,
    scaler: torch.amp.GradScaler | None = None,
    items: int | None = None,
    **kwargs: Any,
) -> None:
    """Run the backward pass of ``loss`` as ``dist`` requires.

    * Accumulation: with ``micro``, the loss is divided by the micro-step's
      group size, so the accumulated gradient is the mean over the group
      (the last, partial group of an epoch included).
    * Loss by item count: with ``items=n``, ``loss`` is the *sum* over this
      micro-batch's ``n`` items (tokens, samples), and it is divided by the
      group's global item count that ``micro_batches(dist, loader, items=count)``
      put in ``micro.items`` (times the data-parallel size, which DDP and FSDP
      divide by again). After the group's syncing ``backward`` every ``.grad``
      is the gradient of (every item's loss in the group, on every rank) /
      (their number): the global mean per token, whatever the lengths.
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
        items: This micro-batch's item count, when ``loss`` is their sum (see above).
        **kwargs: torch's own keywords of ``Tensor.backward``, passed on:
            ``retain_graph``, ``create_graph`` and ``inputs``; any other is refused.

    Raises:
        ArgumentError: ``loss`` is not a tensor, or ``dist`` is missing
            (``backward(loss)``), or a keyword neither faccel's nor torch's.
        ArgumentValueError: ``loss`` is not a scalar (reduce it, e.g. ``.mean()``),
            or ``items`` is negative or above the group's count.
        AccumulationError: Accumulation without ``micro``; ``items`` with a
            micro-step that was not counted, or a counted group's micro-step
            without ``items`` (one group mixes both).
        PrecisionError: fp16 without ``scaler``.

    Example:
        >>> import torch, faccel
        >>> w = torch.ones(2, requires_grad=True)
        >>> faccel.backward(faccel.detect({}), (w * 3).sum())
        >>> w.grad.tolist()
        [3.0, 3.0]
        >>> w.grad = None  # by token count: two micro-batches of 1 and 3 tokens
        >>> dist = faccel.DistState(accumulation_steps=2)
        >>> for micro, tokens in faccel.micro_batches(dist, [[1.0], [2.0, 3.0, 6.0]], items=len):
        ...     faccel.backward(dist, (w[0] * torch.tensor(tokens)).sum(), micro=micro, items=len(tokens))
        >>> w.grad.tolist()  # d/dw0 of the mean over the 4 tokens: (1 + 2 + 3 + 6) / 4
        [3.0, 0.0]
    """
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        _check_loss(dist, loss)
    if kwargs and not kwargs.keys() <= _TORCH_KEYWORDS:
        _check_keywords(kwargs)
    if micro is not None and micro.atom is not None:
        _atom_backward(dist, loss, micro, items, scaler, kwargs)
        return
    if items is not None or (micro is not None and micro.items is not None):
        loss = _by_items(dist, loss, micro, items)
    elif micro is not None:
        if micro.group_size != 1:
            loss = loss / micro.group_size
    elif dist.accumulation_steps != 1:
        msg = (
            f"accumulation_steps is {dist.accumulation_steps} but backward() got no micro-step, so "
            "it cannot scale the loss; iterate faccel.micro_batches(dist, loader) and pass micro="
        )
        raise AccumulationError(msg)
    if dist.strategy == "deepspeed":  # the engine's backward: its reductions, its fp16 loss scale
        from faccel._loop._strategies._deepspeed._engine import engine_backward

        engine_backward(loss, sync=micro is None or micro.sync, dist=dist, **kwargs)
        return
    if scaler is not None and scaler.is_enabled():
        loss = scaler.scale(loss)
    elif dist.precision == "fp16":
        msg = (
            "fp16 training needs loss scaling: create scaler = faccel.grad_scaler(dist) once and "
            "pass scaler= to faccel.backward and faccel.optimizer_step"
        )
        raise PrecisionError(msg)
    runtime = dist.runtime
    runtime.backwards += 1  # how far training had got, for a hang report (one integer add)
    # Once the first optimizer step is done, a shorter timeout, if asked for (applied once).
    if (
        dist.train_timeout is not None
        and runtime.timeout is None
        and runtime.backwards > dist.accumulation_steps
    ):
        runtime.warm_up(dist.train_timeout)
    loss.backward(**kwargs)


# Tensor.backward's own keywords (``gradient`` has no use for a scalar loss).
_TORCH_KEYWORDS = frozenset({"retain_graph", "create_graph", "inputs"})


def _atom_backward(
    dist: DistState,
    loss: torch.Tensor,
    micro: MicroStep,
    items: int | None,
    scaler: torch.amp.GradScaler | None,
    kwargs: dict[str, Any],
) -> None:
    """Exact mode: one atom's piece, weighted as one process weighs it; its accumulator does the rest.

    Nothing divides by the data-parallel size here (the atoms are summed, not
    averaged), so the weight is the same number at every size: the group's
    global item count, or its pieces (batches x atoms).
    """
    group = micro.atom.group  # type: ignore[union-attr]
    group.check_no_sync()
    if items is not None or micro.items is not None:
        loss = loss / max(_check_items(micro, items), 1)
    else:
        loss = loss / (micro.group_size * group.atoms)
    scaled = loss
    if scaler is not None and scaler.is_enabled():
        scaled = scaler.scale(loss)
    elif dist.precision == "fp16":
        msg = (
            "fp16 training needs loss scaling: create scaler = faccel.grad_scaler(dist) once and "
            "pass scaler= to faccel.backward and faccel.optimizer_step"
        )
        raise PrecisionError(msg)
    dist.runtime.backwards += 1
    scaled.backward(**kwargs)
    group.done(micro, loss)


def _check_items(micro: MicroStep | None, items: int | None) -> int:
    """The group's item count; raise unless ``items`` goes with a counted group's micro-step and fits it."""
    if micro is None or micro.items is None:
        msg = (
            "backward(..., items=n) divides the loss sum by the group's item count on every rank, which "
            "needs the count before the group starts: iterate faccel.micro_batches(dist, loader, "
            "items=count) (count: batch -> its items) and pass micro="
        )
        raise AccumulationError(msg)
    if items is None:
        msg = (
            f"micro-step {micro.index} belongs to a group counted by items ({micro.items} in all), but "
            "backward() got no items=: a group mixes losses by item count and means. Pass items=n "
            "(loss the sum over its n items) to every backward of micro_batches(..., items=count)"
        )
        raise AccumulationError(msg)
    if isinstance(items, bool) or not isinstance(items, int) or not 0 <= items <= micro.items:
        msg = f"items must be an int in [0, {micro.items}] (the group's count), got {items!r}"
        raise ArgumentValueError(msg)
    return micro.items


def _by_items(
    dist: DistState, loss: torch.Tensor, micro: MicroStep | None, items: int | None
) -> torch.Tensor:
    """``loss`` (a sum over ``items``) over the group's global count, times what DDP/FSDP divide by."""
    count = _check_items(micro, items)
    # DDP and FSDP average gradients over the data-parallel ranks: multiply that back.
    scale = (dist.data_world_size if dist.distributed else 1) / max(count, 1)
    return loss * scale


def _check_keywords(kwargs: dict[str, Any]) -> None:
    unknown = sorted(set(kwargs) - _TORCH_KEYWORDS)
    msg = (
        f"backward() got unknown keyword(s) {unknown}; it takes micro=, scaler=, items= and torch's own "
        f"Tensor.backward keywords {sorted(_TORCH_KEYWORDS)}"
    )
    raise ArgumentError(msg)


def _check_loss(dist: Any, loss: Any) -> None:
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
