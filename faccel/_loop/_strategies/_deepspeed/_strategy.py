"""DeepSpeed's loop strategy: one engine from the model and its optimizer, ZeRO's backward, step and clipping.

``DeepSpeedStrategy`` hooks the engine (``_engine``: the config faccel fills, the build, the
optimizer and scheduler wrappers, the engine's backward) into the loop; the checkpoint seam's
``_zero_state`` gives ZeRO's partitions as whole tensors to checkpoints and exports. ``deepspeed``
itself is imported only where an engine is built or met.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from faccel._dist._state import DistState
from faccel._loop._options import PrepareOptions
from faccel._loop._strategies._base import LoopStrategy, PrepareOne
from faccel._loop._strategies._deepspeed._config import ConfigOptimizer, ConfigScheduler
from faccel._loop._strategies._deepspeed._engine import (
    engine_backward,
    is_deepspeed_engine,
    prepare_deepspeed,
)
from faccel._marks import DEEPSPEED_ENGINE
from faccel.errors import PrepareError, UsageError

__all__ = ["DeepSpeedStrategy"]


class DeepSpeedStrategy(LoopStrategy):
    """``strategy='deepspeed'``: the engine prepares, steps and clips; faccel's loop runs around it.

    Example:
        >>> import faccel
        >>> DeepSpeedStrategy().applies(faccel.DistState())
        False
    """

    name = "deepspeed"
    whole_model = True  # the engine takes a real model (it partitions it itself under ZeRO-3)
    config_kinds: tuple[type, ...] = (ConfigOptimizer, ConfigScheduler)

    def applies(self, dist: DistState) -> bool:
        """``strategy='deepspeed'``, at any size (one process runs an engine too)."""
        return dist.strategy == "deepspeed"

    def holds(self, model: object, params: Sequence[torch.Tensor] = ()) -> bool:
        """An engine, or parameters an engine holds."""
        return is_deepspeed_engine(model) or any(hasattr(p, DEEPSPEED_ENGINE) for p in params)

    def check_options(self, dist: DistState, options: PrepareOptions) -> None:
        """faccel's activation checkpointing refused (the engine owns the model), then the floor's checks."""
        if options.activation_checkpointing is not None:
            msg = (
                "under strategy='deepspeed' the model goes to DeepSpeed's engine, and faccel's "
                "activation_checkpointing is not applied there (ZeRO partitions the parameters its way); "
                "call torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) in your forward "
                "(or transformers' model.gradient_checkpointing_enable()), or use strategy='fsdp'"
            )
            raise PrepareError(msg)
        super().check_options(dist, options)

    def prepare(self, dist: DistState, objs: Sequence[Any], prepare_one: PrepareOne) -> tuple[Any, ...]:
        """One engine from the model and its optimizer; loaders first (their batch size fills the config)."""
        return prepare_deepspeed(dist, objs, prepare_one)

    def unwrap(self, model: object) -> nn.Module | None:
        """The module an engine holds (under ZeRO-3 its parameters are partitioned)."""
        return model.module if is_deepspeed_engine(model) else None  # type: ignore[attr-defined]

    def backward(self, dist: DistState, loss: torch.Tensor, *, sync: bool, kwargs: dict[str, Any]) -> bool:
        """The engine's backward: its reductions, its fp16 loss scale, ``sync`` as its boundary."""
        engine_backward(loss, sync=sync, dist=dist, **kwargs)
        return True

    def check_clip(self, model_or_params: object, params: Sequence[torch.Tensor]) -> None:
        """Refused: ZeRO's buffers, not the parameters' ``.grad``, hold what the step uses."""
        # ZeRO reduces and partitions the gradients into its own buffers: clipping the parameters'
        # .grad would not change what the step uses, silently.
        msg = (
            "under strategy='deepspeed' the gradients the step uses lie in ZeRO's buffers, not in the "
            "parameters' .grad, and the engine clips them in its step: put the limit in the deepspeed "
            "config, faccel.detect(strategy='deepspeed', deepspeed={..., 'gradient_clipping': MAX_NORM}), "
            "and drop the clip call; model.get_global_grad_norm() gives the norm after optimizer.step()"
        )
        raise UsageError(msg)

    def uneven_problem(self, model: object) -> str | None:
        """ZeRO's collectives have no ``Join`` hook."""
        return (
            "uneven_inputs cannot join a DeepSpeed engine (ZeRO's collectives have no Join hook): keep "
            "prepare(..., even_batches=True) under strategy='deepspeed', which gives every rank the same "
            "number of batches"
        )
