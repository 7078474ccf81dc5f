"""LocalSGD: each rank trains on its own for ``every`` steps, then the ranks average their parameters.

Accelerate's ``LocalSGD(accelerator, model, local_sgd_steps, enabled)`` without
its hidden step counter: the step is a value the loop passes
(``local.step(n)`` averages when ``n % every == 0``). Inside the block DDP does
not all-reduce gradients (its ``no_sync``), and leaving the block averages once
more, so every rank ends with the same parameters. The average is one
collective per dtype (``faccel.reduce``), in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
import torch
from torch import nn

from faccel._dist._collectives import reduce
from faccel._dist._consensus import agree_max
from faccel._dist._state import DistState
from faccel._loop._model import is_sharded, unwrap_model
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentError, ArgumentValueError, PrepareError, SetupMismatchError, UsageError

__all__ = ["LocalSGD", "average_parameters", "local_sgd"]


def average_parameters(dist: DistState, model: nn.Module) -> None:
    """Set every parameter of ``model`` to its mean over the ranks, in place (one collective per dtype).

    Example:
        >>> import torch, faccel
        >>> model = torch.nn.Linear(2, 1)
        >>> before = model.weight.clone()
        >>> average_parameters(faccel.detect({}), model)
        >>> torch.equal(model.weight, before)
        True
    """
    _average(dist, model, at=None)


def _average(dist: DistState, model: nn.Module, *, at: int | None) -> None:
    """Average ``model``'s parameters; with ``at`` (the step, 0 for the block's end), the ranks' steps
    travel with them (``at`` and its square, averaged: both means are this rank's own values on every
    rank only when every rank gave the same step), and a difference is refused before any is copied."""
    if not dist.distributed:
        return
    params = [p for p in unwrap_model(model).parameters()]
    tree: list[torch.Tensor] = [p.detach() for p in params]
    if at is not None:
        tree.append(torch.tensor([float(at), float(at) ** 2], dtype=torch.float64))
    averaged = reduce(dist, tree, op="mean")
    if at is not None:
        mean, square = averaged.pop().tolist()
        if mean != at or square != float(at) ** 2:
            here = "the end of the local_sgd block" if at == 0 else f"local.step({at})"
            msg = (
                f"local_sgd on rank {dist.rank}: the ranks averaged at different steps (this rank at "
                f"{here}; the ranks' mean step is {mean:g}). Pass local.step(n) the same n on every rank "
                "(the optimizer steps so far, counted alike), and call it after every optimizer step on "
                "every rank; nothing was averaged"
            )
            raise UsageError(msg)
    with torch.no_grad():
        for param, mean_param in zip(params, averaged, strict=True):
            param.copy_(mean_param)


@attrs.frozen(kw_only=True)
class LocalSGD:
    """A LocalSGD block's settings: which model, how often its ranks average (see :func:`local_sgd`).

    Example:
        >>> import torch, faccel
        >>> local = LocalSGD(dist=faccel.detect({}), model=torch.nn.Linear(2, 1), every=2)
        >>> local.step(1), local.step(2)
        (False, True)
    """

    dist: DistState
    model: nn.Module
    every: int
    enabled: bool = True

    def step(self, step: int) -> bool:
        """Average the parameters when ``step`` (optimizer steps so far, from 1) is a multiple of ``every``.

        Returns whether it averaged. Call it on every rank after each optimizer step.

        Raises:
            ArgumentError: ``step`` is not an int (``local.step("3")``).
            ArgumentValueError: ``step`` < 1.
            UsageError: (on every rank) the ranks averaged at different steps; nothing is averaged.
        """
        if type(step) is not int or step < 1:
            msg = f"local.step(n) takes n, the optimizer steps so far (an int >= 1), got {step!r}"
            raise (ArgumentValueError if type(step) is int else ArgumentError)(msg)
        if not self.enabled or step % self.every != 0:
            return False
        _average(self.dist, self.model, at=step)
        return True


@contextlib.contextmanager
@setup_checked
def local_sgd(dist: DistState, model: nn.Module, *, every: int, enabled: bool = True) -> Iterator[LocalSGD]:
    """Train with LocalSGD in the block: no gradient all-reduce, parameters averaged every ``every`` steps.

    Under DDP the block runs inside the model's ``no_sync()``, so each rank
    steps on its own gradients; ``local.step(n)`` after the ``n``-th optimizer
    step averages the parameters when ``n % every == 0``, and leaving the block
    averages once more. ``enabled=False`` makes it plain DDP (one script for
    both). In one process nothing changes.

    Args:
        dist: The run's :class:`DistState`.
        model: The prepared model.
        every: Optimizer steps between averages (Accelerate's ``local_sgd_steps``).
        enabled: False: no ``no_sync``, no averaging.

    Yields:
        A :class:`LocalSGD` whose ``step(n)`` averages on the multiples of ``every``.

    Raises:
        ArgumentError: ``every`` is not an int (``every=2.5``), ``enabled`` not a bool.
        ArgumentValueError: ``every`` < 1.
        SetupMismatchError: (on every rank) ``every`` or ``enabled`` differs between ranks.
        PrepareError: an FSDP2 (sharded) model or a DeepSpeed engine: LocalSGD averages whole replicas.

    Example:
        >>> import torch, faccel
        >>> dist = faccel.detect({})
        >>> model = faccel.prepare(dist, torch.nn.Linear(2, 1))
        >>> with faccel.local_sgd(dist, model, every=4) as local:
        ...     averaged = [local.step(n) for n in range(1, 9)]
        >>> averaged.count(True)
        2
    """
    if type(every) is not int or every < 1:
        msg = f"every must be an int >= 1 (optimizer steps between averages), got {every!r}"
        raise (ArgumentValueError if type(every) is int else ArgumentError)(msg)
    if is_sharded(unwrap_model(model)) or dist.strategy == "deepspeed":
        msg = (
            "local_sgd averages whole replicas of the model, and this one is sharded (FSDP2) or a "
            "DeepSpeed engine; use strategy='ddp' for LocalSGD"
        )
        raise PrepareError(msg)
    if type(enabled) is not bool:
        msg = f"enabled must be True or False, got {enabled!r}"
        raise ArgumentError(msg)
    _agree(dist, every=every, enabled=enabled)
    local = LocalSGD(dist=dist, model=model, every=every, enabled=enabled)
    sync = getattr(model, "no_sync", None)
    with sync() if enabled and sync is not None else contextlib.nullcontext():
        yield local
    if enabled:
        _average(dist, model, at=0)


def _agree(dist: DistState, *, every: int, enabled: bool) -> None:
    """Refuse, on every rank, a block whose ``every`` or ``enabled`` differs between ranks (one collective).

    One rank in ``no_sync`` and another all-reducing its gradients would meet in
    different collectives; ranks averaging at other multiples would average
    different steps.
    """
    if not dist.distributed:
        return
    # One maximum of each value and of its negation: the lowest and the highest over the ranks.
    agreed = agree_max(
        dist, [-every, every, -int(enabled), int(enabled)], what="local_sgd's agreement", raises=UsageError
    )
    low_every, high_every, low_enabled, high_enabled = -agreed[0], agreed[1], -agreed[2], agreed[3]
    if low_every != high_every or low_enabled != high_enabled:
        what = (
            f"every from {low_every} to {high_every}"
            if low_every != high_every
            else "enabled True on some ranks and False on others"
        )
        msg = (
            f"local_sgd on rank {dist.rank} (every={every}, enabled={enabled}): the ranks were given "
            f"different settings ({what}); pass the same every and enabled on every rank"
        )
        raise SetupMismatchError(msg)
