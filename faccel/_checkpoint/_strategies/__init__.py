"""Strategy states: what each strategy contributes to checkpoints and exports, one module each.

``_base`` holds the protocol (:class:`StrategyState`) and its records; ``_plain`` (one process),
``_ddp``, ``_fsdp`` (FSDP2, HSDP, tensor parallelism), ``_zero`` (DeepSpeed) and ``_pipeline``
(pipeline stages) implement it.
:func:`strategy_of` picks a model's, from the table ``STRATEGY_STATES``: the first row that holds it.
A new strategy is a module here and a row there, nothing elsewhere.
"""

from __future__ import annotations

from faccel._checkpoint._strategies._base import ExportKind, Ownership, StrategyState, Whole
from faccel._checkpoint._strategies._ddp import DDPState
from faccel._checkpoint._strategies._fsdp import FsdpState
from faccel._checkpoint._strategies._pipeline import PipelineState
from faccel._checkpoint._strategies._plain import PlainState
from faccel._checkpoint._strategies._zero import ZeroState

__all__ = ["ExportKind", "Ownership", "StrategyState", "Whole", "strategy_of"]

# First match wins; PlainState holds every model, so it comes last.
STRATEGY_STATES: tuple[StrategyState, ...] = (
    PipelineState(),
    ZeroState(),
    FsdpState(),
    DDPState(),
    PlainState(),
)


def strategy_of(model: object) -> StrategyState:
    """The strategy state of ``model`` (as prepared: wrapped or not): the first row that holds it.

    Example:
        >>> import torch
        >>> strategy_of(torch.nn.Linear(2, 1)).name
        'plain'
    """
    return next(strategy for strategy in STRATEGY_STATES if strategy.holds(model))
