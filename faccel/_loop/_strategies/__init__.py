"""The training loop's strategies: one room each, behind one protocol, chosen from one table.

``_base`` holds the protocol (:class:`LoopStrategy`, a class whose own answers are the floor's:
what a plain model does); ``_plain`` (one process), ``_ddp``, ``_fsdp`` (FSDP2), ``_mesh`` (tensor
parallelism and HSDP on the DeviceMesh), ``_deepspeed`` (DeepSpeed's ZeRO) and ``_pipeline``
(pipeline stages) implement it. ``LOOP_STRATEGIES`` is the one list of them:
:func:`loop_strategy` picks a run's (the first row that applies to its ``DistState``),
:func:`holding` a prepared model's (the first row that holds it). A new strategy is a module
here and a row there, nothing elsewhere (docs/architecture.md, "how to add a strategy").
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from faccel._dist._state import DistState
from faccel._loop._model import peel
from faccel._loop._strategies._base import LoopStrategy
from faccel._loop._strategies._ddp._strategy import DDPStrategy
from faccel._loop._strategies._deepspeed._strategy import DeepSpeedStrategy
from faccel._loop._strategies._fsdp import FsdpStrategy
from faccel._loop._strategies._mesh._strategy import MeshStrategy
from faccel._loop._strategies._pipeline._stages import Schedule
from faccel._loop._strategies._pipeline._strategy import PipelineStrategy
from faccel._loop._strategies._plain import PlainStrategy

__all__ = [
    "LOOP_STRATEGIES",
    "LoopStrategy",
    "Schedule",
    "given_model",
    "holding",
    "loop_strategy",
    "unwrap_model",
]

# First match wins. DeepSpeed and pipeline stages first (their DistStates are refused any other
# layout), the DeviceMesh before FSDP2 (a mesh layout may be strategy='fsdp' too), DDP for the
# peer processes left, one process last: PlainStrategy applies to and holds everything.
LOOP_STRATEGIES: tuple[LoopStrategy, ...] = (
    DeepSpeedStrategy(),
    PipelineStrategy(),
    MeshStrategy(),
    FsdpStrategy(),
    DDPStrategy(),
    PlainStrategy(),
)

# Objects that stand for a section of some strategy's config: refused by ``prepare`` under the others.
CONFIG_KINDS: tuple[type, ...] = tuple(kind for strategy in LOOP_STRATEGIES for kind in strategy.config_kinds)


def loop_strategy(dist: DistState) -> LoopStrategy:
    """The strategy ``dist``'s run uses: the first row of ``LOOP_STRATEGIES`` that applies.

    Example:
        >>> import faccel
        >>> loop_strategy(faccel.DistState()).name, loop_strategy(faccel.DistState(strategy="fsdp")).name
        ('plain', 'plain')
    """
    runtime = dist.runtime
    chosen = runtime.chosen
    if chosen is not None and chosen[0]() is dist:  # the same record asked before: its choice holds
        return chosen[1]  # type: ignore[no-any-return]
    strategy = next(strategy for strategy in LOOP_STRATEGIES if strategy.applies(dist))
    runtime.chosen = (weakref.ref(dist), strategy)
    return strategy


def holding(model: object, params: Sequence[torch.Tensor] = ()) -> LoopStrategy:
    """The strategy of a prepared ``model`` (or of ``params`` given to clipping): the first row that holds it.

    Example:
        >>> import torch
        >>> holding(torch.nn.Linear(2, 1)).name
        'plain'
    """
    return next(strategy for strategy in LOOP_STRATEGIES if strategy.holds(model, params))


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside every wrapper that ``prepare`` (or ``torch.compile``) added.

    A DeepSpeed engine gives its module (under ZeRO-3 its parameters are
    partitioned: save it with :func:`faccel.save_model`, which gathers them).

    Example:
        >>> import torch, faccel
        >>> net = torch.nn.Linear(2, 1)
        >>> dist = faccel.DistState.simulated(precision="bf16")
        >>> faccel.unwrap_model(faccel.prepare(dist, net)) is net
        True
    """
    while True:
        model = peel(model)  # torch's layers and autocast
        inner = next((m for strategy in LOOP_STRATEGIES if (m := strategy.unwrap(model)) is not None), None)
        if inner is None:
            return model
        model = inner


def given_model(model: nn.Module) -> nn.Module:
    """The user's whole model that ``prepare`` was given, unwrapped (pipeline stages: the model cut).

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(2, 1)
        >>> given_model(net) is net
        True
    """
    whole = holding(model).given(model)
    return unwrap_model(whole if whole is not None else model)
