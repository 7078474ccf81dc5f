"""DeepSpeed's ZeRO: the strategy state of an engine, whose partitions a checkpoint holds whole.

A DeepSpeed checkpoint is the whole-tensor format (version 3) of an unsharded run: the model's
whole tensors and the torch optimizer's state over whole tensors, gathered one parameter at a
time and scattered back by DeepSpeed's room (``_loop/_strategies/_deepspeed/_zero_state.py``),
so it restores at any world size and ZeRO stage. The sharded format is refused (ZeRO's flat
partitions are not row shards). ZeRO-3's partitioned parameters are ``meta`` stand-ins of
their whole shape in :meth:`ZeroState.target`, and its ``save_model`` gathers them tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from faccel._checkpoint._strategies._base import ExportKind, Ownership, Whole
from faccel._checkpoint._strategies._plain import PlainState
from faccel._loop._strategies._deepspeed._engine import DeepSpeedOptimizer, is_deepspeed_engine
from faccel._loop._strategies._deepspeed._zero_state import (
    full_state,
    gather_named,
    has_partitioned_parameters,
    load_full_state,
    target_state,
    whole_specs,
)

if TYPE_CHECKING:
    from faccel._dist._state import DistState

__all__ = ["ZeroState"]


class ZeroState(PlainState):
    """The strategy state of a DeepSpeed engine (see the module's docstring)."""

    name = "deepspeed"
    # The engine loads through ZeRO's own setters (collectives under ZeRO-3); its shapes and its
    # optimizer's whole-tensor state are checked instead (``_verify``).
    staged = frozenset()

    def holds(self, model: object) -> bool:
        """A DeepSpeed engine (``faccel.prepare`` under ``strategy='deepspeed'``)."""
        return is_deepspeed_engine(model)

    def whole_state(self, dist: DistState, model: Any, optimizer: Any) -> Whole | None:
        """ZeRO's partitions gathered whole on the main process, one tensor at a time (a collective)."""
        return full_state(dist, model, optimizer)

    def sharded_problem(self, dist: DistState, model: object) -> str | None:
        """Always: ZeRO's flat partitions are written whole."""
        return (
            "checkpoint(..., sharded=True) of a DeepSpeed run: faccel writes ZeRO's partitions as whole "
            "tensors (gathered one at a time), which restore at any world size and ZeRO stage; pass "
            "sharded=False or leave it out"
        )

    def target(self, model: object) -> dict[str, torch.Tensor]:
        """The module's state dict, a ZeRO-3 partitioned parameter as a ``meta`` tensor of its whole shape."""
        return target_state(model)

    def ownership(self, model: object) -> Ownership:
        """Every name, whole (gathered where ZeRO partitions it)."""
        return Ownership()

    def optimizer_view(self, optimizer: Any) -> tuple[list[dict[str, Any]], Any]:
        """The parameters as the torch optimizer held them before ZeRO flattened its groups."""
        if isinstance(optimizer, DeepSpeedOptimizer):
            return optimizer.checkpoint_groups(), optimizer.optimizer
        return super().optimizer_view(optimizer)

    def load(
        self,
        model: Any,
        optimizer: Any,
        model_state: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, Any] | None,
    ) -> bool:
        """Whole tensors into ZeRO's partitions and fp32 masters (a collective under ZeRO-3)."""
        load_full_state(model, optimizer, model_state, optimizer_state)
        return True

    def export_kind(self, model: object) -> ExportKind:
        """ZeRO-3: gathered tensor by tensor; ZeRO-1/2 hold the weights whole: the main process."""
        return "gathered" if has_partitioned_parameters(model) else "main"

    def whole_specs(
        self, model: object
    ) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, str]]:
        """The engine names the ties: ZeRO-3's stand-ins have no memory to tell them by."""
        return whole_specs(model)

    def gather_named(self, model: object, names: Sequence[str], *, keep: bool) -> dict[str, torch.Tensor]:
        """Each ZeRO-3 parameter gathered alone (a collective)."""
        return gather_named(model, names, keep=keep)

    def load_weights(self, model: object, tensors: Mapping[str, torch.Tensor]) -> None:
        """Into the module, ZeRO's partitions and its fp32 masters (a collective under ZeRO-3)."""
        load_full_state(model, None, tensors, None)
