"""One process, or any wrapper whose module holds every tensor whole (the fallback strategy).

The state a checkpoint writes is the live objects' own state dicts, loaded back through their
``load_state_dict`` (tried first on throwaway copies, ``_stage``); the main process writes the
export. Every rank owns every name, whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from faccel._checkpoint._strategies._base import ExportKind, Ownership, Whole
from faccel._loop._strategies import unwrap_model
from faccel._storage._weights import alias_groups

if TYPE_CHECKING:
    from faccel._checkpoint._sharded._chunks import Held
    from faccel._dist._state import DistState

__all__ = ["PlainState"]


class PlainState:
    """The strategy state of a model held whole by this process (see the module's docstring)."""

    name = "plain"
    staged = frozenset({"model", "optimizer"})

    def holds(self, model: object) -> bool:
        """Every model: the last row of the table."""
        return True

    def whole_state(self, dist: DistState, model: Any, optimizer: Any) -> Whole | None:
        """None: the live state dicts are whole."""
        return None

    def shard_state(self, model: Any, optimizer: Any) -> Whole | None:
        """None: the live state dicts, split between the ranks by the chunk rule."""
        return None

    def held(self, tensor: torch.Tensor) -> Held | None:
        """None: the chunk rule over all ranks places every tensor."""
        return None

    def sharded_problem(self, dist: DistState, model: object) -> str | None:
        """None: any whole tensor fits the sharded format."""
        return None

    def shards_by_default(self, dist: DistState, model: object) -> bool:
        """False: whole tensors, version 3."""
        return False

    def target(self, model: object) -> dict[str, torch.Tensor]:
        """The unwrapped module's state dict."""
        return dict(unwrap_model(model).state_dict())  # type: ignore[arg-type]

    def ownership(self, model: object) -> Ownership:
        """Every name, whole."""
        return Ownership()

    def owns_param(self, param: object) -> bool:
        """Every parameter's state."""
        return True

    def optimizer_view(self, optimizer: Any) -> tuple[list[dict[str, Any]], Any]:
        """The optimizer's own groups."""
        return list(optimizer.param_groups), optimizer

    def load(
        self,
        model: Any,
        optimizer: Any,
        model_state: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, Any] | None,
    ) -> bool:
        """False: the objects' own ``load_state_dict``."""
        return False

    def export_kind(self, model: object) -> ExportKind:
        """The main process writes."""
        return "main"

    def whole_specs(
        self, model: object
    ) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, str]]:
        """From the state dict itself."""
        state = self.target(model)
        return {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}, alias_groups(state)

    def gather_named(self, model: object, names: Sequence[str], *, keep: bool) -> dict[str, torch.Tensor]:
        """The tensors as they are (nothing to gather)."""
        state = self.target(model)
        return {name: state[name].detach() for name in names} if keep else {}

    def load_weights(self, model: object, tensors: Mapping[str, torch.Tensor]) -> None:
        """``load_state_dict(strict=False)`` of the unwrapped module (names checked before)."""
        unwrap_model(model).load_state_dict(tensors, strict=False)  # type: ignore[arg-type]
