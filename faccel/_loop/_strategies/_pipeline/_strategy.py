"""Pipeline stages' loop strategy: the model cut into stages (``_stages``), each wrapped as a whole model
would be (tensor parallelism, FSDP2 over its block's data ranks), stepped by a schedule.

``PipelineStrategy`` hooks the stages into the loop: ``prepare`` cuts the model
(``pipelined``), ``forward_backward`` runs the schedule, clipping takes the norm over every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from faccel._dist._state import DistState
from faccel._loop._options import PrepareOptions
from faccel._loop._strategies._base import LoopStrategy
from faccel._loop._strategies._pipeline._stages import PipelinedModel, clip_stages, pipeline_step, pipelined

__all__ = ["PipelineStrategy"]


class PipelineStrategy(LoopStrategy):
    """A layout with ``pipeline > 1``: this rank's stages, stepped by :func:`faccel.forward_backward`.

    Example:
        >>> import faccel
        >>> dist = faccel.DistState.simulated(world_size=2, layout=faccel.Layout(pipeline=2), strategy="fsdp")
        >>> PipelineStrategy().applies(dist)
        True
    """

    name = "pipeline"

    def applies(self, dist: DistState) -> bool:
        """A layout with pipeline stages (a default layout has none)."""
        return dist.layout is not None and dist.layout.pipeline > 1

    def holds(self, model: object, params: Sequence[torch.Tensor] = ()) -> bool:
        """A :class:`PipelinedModel`."""
        return isinstance(model, PipelinedModel)

    def prepare_model(self, dist: DistState, model: nn.Module, options: PrepareOptions) -> nn.Module:
        """Cut into stages, built at the first ``forward_backward`` (or at ``prepare`` with ``example=``)."""
        return pipelined(dist, model, options)

    def given(self, model: object) -> nn.Module | None:
        """The whole model that was cut into stages."""
        return model.source  # type: ignore[attr-defined,no-any-return]  # a PipelinedModel (holds)

    def replaces_parameters(self, dist: DistState) -> bool:
        """The stages' wrapping (FSDP2, tensor parallelism) replaces parameters on peer processes."""
        return dist.distributed and (dist.strategy == "fsdp" or dist.parallel.tensor > 1)

    def forward_backward(
        self,
        dist: DistState,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        args: tuple[Any, ...],
        targets: Any,
        *,
        micro: Any,
        items: int | None,
        scaler: torch.amp.GradScaler | None,
    ) -> torch.Tensor | None:
        """The schedule's step over this rank's stages (``model`` is a :class:`PipelinedModel`)."""
        return pipeline_step(dist, model, loss_fn, args, targets, micro=micro, items=items)  # type: ignore[arg-type]

    def clip_grad_norm(
        self,
        dist: DistState,
        params: list[torch.Tensor],
        max_norm: float,
        *,
        norm_type: float,
        error_if_nonfinite: bool,
        foreach: bool | None,
    ) -> torch.Tensor | None:
        """The norm over every stage of the pipeline, the same on every rank."""
        return clip_stages(
            dist,
            params,
            max_norm,
            norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
        )
