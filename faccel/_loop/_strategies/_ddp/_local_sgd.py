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
from faccel._dist._state import DistState
from faccel._loop._model import is_sharded, unwrap_model
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentValueError, PrepareError

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
    if not dist.distributed:
        return
    params = [p for p in unwrap_model(model).parameters()]
    averaged = reduce(dist, [p.detach() for p in params], op="mean")
    with torch.no_grad():
        for param, mean in zip(params, averaged, strict=True):
            param.copy_(mean)


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
        """
        if not self.enabled or step % self.every != 0:
            return False
        average_parameters(self.dist, self.model)
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
        ArgumentValueError: ``every`` < 1.
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
        raise ArgumentValueError(msg)
    if is_sharded(unwrap_model(model)) or dist.strategy == "deepspeed":
        msg = (
            "local_sgd averages whole replicas of the model, and this one is sharded (FSDP2) or a "
            "DeepSpeed engine; use strategy='ddp' for LocalSGD"
        )
        raise PrepareError(msg)
    local = LocalSGD(dist=dist, model=model, every=every, enabled=enabled)
    sync = getattr(model, "no_sync", None)
    with sync() if enabled and sync is not None else contextlib.nullcontext():
        yield local
    if enabled:
        average_parameters(dist, model)
