"""The strategy-state protocol: what a strategy contributes to checkpoints and exports.

A strategy (one process, DDP, FSDP2 / HSDP / tensor parallelism, DeepSpeed's ZeRO, and
pipeline stages) holds a model's state its own way: whole on every rank, in row shards
(DTensors), in flat partitions. Checkpoints (``_save``, ``_restore``, ``_verify``, ``_load``)
and exports (``_hf``) never ask which strategy runs; they ask its :class:`StrategyState`
(``strategy_of(model)`` in this package picks it once), which answers:

- **saving**: :meth:`~StrategyState.whole_state` (whole tensors on the main process, for the
  whole-tensor format; a collective), :meth:`~StrategyState.shard_state` (this rank's pieces,
  for the sharded format), and whether the sharded format can hold this model
  (:meth:`~StrategyState.sharded_problem`, :meth:`~StrategyState.shards_by_default`);
- **restoring**: :meth:`~StrategyState.target` (the state dict a checkpoint's model must fit),
  :meth:`~StrategyState.optimizer_view` (the param groups a checkpoint numbers), what may be
  tried on throwaway copies (:attr:`~StrategyState.staged`) and :meth:`~StrategyState.load`
  (whole tensors into the live objects; a collective where the strategy needs one);
- **ownership**: :meth:`~StrategyState.ownership`, the names (and rows) this rank holds.
  A rank that holds only some names (a pipeline stage) is ordinary: every path that reads
  or compares names goes through it;
- **exports** (``save_model`` / ``load_model``): :meth:`~StrategyState.export_kind` (who writes:
  the main process, every rank its share, or tensor by tensor gathered),
  :meth:`~StrategyState.whole_specs`, :meth:`~StrategyState.gather_named` and
  :meth:`~StrategyState.load_weights`.

A new strategy is one module of this package implementing the protocol and one row of
``STRATEGY_STATES`` in ``__init__.py`` (docs/architecture.md, "where a new feature goes").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import attrs
import torch

if TYPE_CHECKING:
    from faccel._checkpoint._sharded._chunks import Held
    from faccel._dist._state import DistState

__all__ = ["ExportKind", "Ownership", "StrategyState", "Whole"]

# Whole model and optimizer state dicts (the optimizer's keyed by parameter index, torch's form);
# on ranks other than the main process the model's may be empty.
Whole = tuple[Mapping[str, Any], Mapping[str, Any] | None]
# Who writes a model's Hugging Face export: the main process alone ("main"), every rank its share
# of the tensors ("spread"), or the main process tensor by tensor as all ranks gather ("gathered").
ExportKind = Literal["main", "spread", "gathered"]


@attrs.frozen(kw_only=True)
class Ownership:
    """The state-dict names this rank holds (``None``: every name), and the rows of each it holds.

    ``rows`` maps a name held in part (a row shard) to ``(start, stop)``; a name held and not
    in ``rows`` is held whole.

    Example:
        >>> stage = Ownership(names=frozenset({"blocks.0.weight"}))
        >>> stage.owns("blocks.0.weight"), stage.owns("head.weight"), Ownership().owns("head.weight")
        (True, False, True)
    """

    names: frozenset[str] | None = None
    rows: Mapping[str, tuple[int, int]] = attrs.field(factory=dict)
    # Where ``names`` is some of the model's: every name of the whole model (the union of the stages),
    # so that each rank checks that a checkpoint holds the whole model, no more, no less.
    model_names: frozenset[str] | None = None

    def owns(self, name: str) -> bool:
        """Whether this rank holds ``name`` (whole, or some of its rows)."""
        return self.names is None or name in self.names

    @property
    def every_name(self) -> bool:
        """Whether this rank holds every name of the model (no pipeline stage)."""
        return self.names is None


class StrategyState(Protocol):
    """What a strategy contributes to checkpoints and exports (see the module's docstring)."""

    name: str
    # Which loads of a restore may be tried first on a throwaway copy of the object: those of
    # objects whose own load_state_dict the restore calls ("model", "optimizer").
    staged: frozenset[str]

    def holds(self, model: object) -> bool:
        """Whether ``model`` (as the user passes it: wrapped or not) is held by this strategy."""
        ...

    def whole_state(self, dist: DistState, model: Any, optimizer: Any) -> Whole | None:
        """Whole tensors for the whole-tensor format, on the main process; None: the live objects'
        own state dicts are whole. A collective where the strategy gathers: every rank calls it,
        inside the ranks' agreement (a lost peer becomes the caller's named error)."""
        ...

    def shard_state(self, model: Any, optimizer: Any) -> Whole | None:
        """This rank's pieces for the sharded format (DTensors); None: the live state dicts."""
        ...

    def held(self, tensor: torch.Tensor) -> Held | None:
        """Where a tensor of :meth:`shard_state` lies when this strategy decides it (which ranks write
        its chunks, and how this rank gets its own); None: the chunk rule over all ranks decides."""
        ...

    def sharded_problem(self, dist: DistState, model: object) -> str | None:
        """Why ``checkpoint(..., sharded=True)`` cannot write this model, or None."""
        ...

    def shards_by_default(self, dist: DistState, model: object) -> bool:
        """Whether ``checkpoint(..., sharded=None)`` writes the sharded format."""
        ...

    def target(self, model: object) -> dict[str, torch.Tensor]:
        """The state dict a checkpoint's model must fit, whole shapes (``meta`` where no data is
        here), the names this rank owns only."""
        ...

    def ownership(self, model: object) -> Ownership:
        """The names (and rows) of the model's state this rank holds."""
        ...

    def owns_param(self, param: object) -> bool:
        """Whether this rank holds ``param``'s optimizer state (a pipeline stage holds its own only)."""
        ...

    def optimizer_view(self, optimizer: Any) -> tuple[list[dict[str, Any]], Any]:
        """The param groups a checkpoint numbers the parameters by, and the torch optimizer."""
        ...

    def load(
        self,
        model: Any,
        optimizer: Any,
        model_state: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, Any] | None,
    ) -> bool:
        """Load checked whole (or this rank's) tensors into the model and optimizer, where the
        strategy loads its own way (a collective: every rank calls it); False: through the objects'
        own ``load_state_dict``."""
        ...

    def export_kind(self, model: object) -> ExportKind:
        """Who writes the model's Hugging Face export."""
        ...

    def whole_specs(
        self, model: object
    ) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, str]]:
        """Each state-dict name's whole dtype and shape, and tied names ``{later: first}``; no data."""
        ...

    def gather_named(self, model: object, names: Sequence[str], *, keep: bool) -> dict[str, torch.Tensor]:
        """The whole tensors of ``names`` (kept only where ``keep``); a collective where it gathers."""
        ...

    def load_weights(self, model: object, tensors: Mapping[str, torch.Tensor]) -> None:
        """``load_model``'s whole tensors of some names into the model (a collective where needed)."""
        ...
