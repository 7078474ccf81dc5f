"""FSDP2 (and HSDP, tensor parallelism): the strategy state of a model held in DTensors.

:class:`FsdpState` is its row of the strategy table; below it, its state dicts: each rank's
shards, or whole tensors gathered and scattered.

The sharded format (version 2) takes each rank's own shards
(:func:`sharded_state`: DTensors, the optimizer state keyed by parameter index
as ``torch.optim.Optimizer.state_dict`` keys it); nothing crosses ranks. The
whole-tensor format (version 3, and older checkpoints) is written from
:func:`full_state`, which gathers the whole model and optimizer state on
rank 0 (``cpu_offload``), and read back through :func:`load_full_state`.

Gathering and scattering go through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict`` / ``set_state_dict``), PyTorch's own API for FSDP2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from faccel._checkpoint._sharded._chunks import row_split
from faccel._checkpoint._strategies._base import ExportKind, Ownership, Whole
from faccel._checkpoint._strategies._plain import PlainState
from faccel._loop._model import is_sharded
from faccel._loop._strategies import unwrap_model
from faccel._torch_compat import is_dtensor, local_rows

if TYPE_CHECKING:
    from faccel._dist._state import DistState

__all__ = ["FsdpState", "full_state", "load_full_state", "sharded_state"]


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def _by_index(optimizer_state: Mapping[str, Any]) -> dict[str, Any]:
    """FQN-keyed optimizer state (DCP's form) -> index-keyed (torch.optim's form)."""
    index: dict[str, int] = {}
    groups = []
    for group in optimizer_state["param_groups"]:
        ids = []
        for name in group["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        groups.append({**group, "params": ids})
    state = {index[name]: value for name, value in optimizer_state["state"].items()}
    return {"state": state, "param_groups": groups}


def _by_name(optimizer_state: Mapping[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """Index-keyed optimizer state -> FQN-keyed, with ``names`` the FQNs of each group's params."""
    flat: dict[int, str] = {}
    groups = []
    for group, group_names in zip(optimizer_state["param_groups"], names, strict=True):
        flat.update(dict(zip(group["params"], group_names, strict=True)))
        groups.append({**group, "params": list(group_names)})
    state = {flat[int(i)]: value for i, value in optimizer_state["state"].items()}
    return {"state": state, "param_groups": groups}


def _group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    return [[by_id[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The whole model (and optimizer) state of a sharded model, on rank 0, on the CPU.

    A collective: every rank must call it. Other ranks get empty dicts.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    options = _options(cpu_offload=True)
    if optimizer is None:
        return get_model_state_dict(model, options=options), None
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return model_state, (_by_index(optimizer_state) if optimizer_state else {})


def sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """This rank's shards of the model (and optimizer) state: DTensors, no copy, no communication
    beyond what ``get_state_dict`` itself needs. The optimizer state is keyed by parameter index.

    A collective: every rank must call it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    options = StateDictOptions(full_state_dict=False)
    if optimizer is None:
        return get_model_state_dict(model, options=options), None
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return model_state, (_by_index(optimizer_state) if optimizer_state else {})


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any] | None,
) -> None:
    """Load whole state dicts into a sharded model (and its optimizer), each rank keeping its shard.

    A collective: every rank must call it with the same whole dicts.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    options = _options()
    if optimizer is None or optimizer_state is None:
        set_model_state_dict(model, dict(model_state), options=options)
        return
    named = _by_name(optimizer_state, _group_names(model, optimizer))
    set_state_dict(
        model, optimizer, model_state_dict=dict(model_state), optim_state_dict=named, options=options
    )
    # set_state_dict rebuilds hyperparameters through lists (Adam's betas come back as a
    # list); put back the saved values, tuples included, as load_state_dict would.
    for group, saved in zip(optimizer.param_groups, optimizer_state["param_groups"], strict=True):
        group.update({key: value for key, value in saved.items() if key != "params"})


class FsdpState(PlainState):
    """The strategy state of a model whose parameters are DTensors faccel made (FSDP2, HSDP, TP)."""

    name = "fsdp"
    # The model loads through set_state_dict (a collective): only the optimizer is tried on a copy.
    staged = frozenset({"optimizer"})

    def holds(self, model: object) -> bool:
        """FSDP2's ``fully_shard`` or tensor parallelism, under faccel's wrappers."""
        return is_sharded(unwrap_model(model))  # type: ignore[arg-type]

    def whole_state(self, dist: DistState, model: Any, optimizer: Any) -> Whole | None:
        """The whole state gathered on rank 0 (a collective)."""
        return full_state(unwrap_model(model), optimizer)

    def shard_state(self, model: Any, optimizer: Any) -> Whole | None:
        """This rank's shards (DTensors), no copy."""
        return sharded_state(unwrap_model(model), optimizer)

    def _split(self, dist: DistState, model: object) -> bool:
        return all(row_split(p, dist.world_size) for p in unwrap_model(model).parameters())  # type: ignore[arg-type]

    def sharded_problem(self, dist: DistState, model: object) -> str | None:
        """Parameters not split by rows over all ranks (HSDP, tensor parallelism)."""
        if self._split(dist, model):
            return None
        return (
            "checkpoint(..., sharded=True): the model's parameters are not all split by rows over "
            f"all {dist.world_size} ranks (HSDP or tensor parallelism?); the sharded format needs "
            "that layout. Pass sharded=False (whole tensors, gathered on rank 0)"
        )

    def shards_by_default(self, dist: DistState, model: object) -> bool:
        """The sharded format whenever it can hold the model: no rank gathers the whole state."""
        return self._split(dist, model)

    def ownership(self, model: object) -> Ownership:
        """Every name; of a row-split DTensor, its local rows."""
        rows = {
            name: local_rows(tensor)
            for name, tensor in self.target(model).items()
            if is_dtensor(tensor) and row_split(tensor, tensor.device_mesh.size())  # type: ignore[attr-defined]
        }
        return Ownership(rows=rows)

    def load(
        self,
        model: Any,
        optimizer: Any,
        model_state: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, Any] | None,
    ) -> bool:
        """Whole tensors (versions 1 and 3) scattered into each rank's shards (a collective);
        DTensors of this rank's rows (version 2): through ``load_state_dict``."""
        if any(is_dtensor(t) for t in model_state.values()):
            return False
        load_full_state(unwrap_model(model), optimizer, model_state, optimizer_state)
        return True

    def export_kind(self, model: object) -> ExportKind:
        """Every rank writes its share, never the whole model on one rank."""
        return "spread"
