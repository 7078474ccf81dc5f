"""Pipeline stages: the strategy state of a :class:`~faccel._loop._pipeline.PipelinedModel`.

A stage's rank holds only its stages' names. A checkpoint of it is the sharded format (version 2),
keyed by the original model's names, exactly as an unpipelined model's: every rank plans the whole
model's index (the names of every stage, learned in one small exchange of names and shapes, no
tensor data), and each tensor is written whole by the rank that holds it (its chunk rule's
``first`` is that rank: the index records which rank wrote each name). The optimizer state is
numbered as the whole model's optimizer numbers it: each group's parameters in the model's order
(the groups given to the optimizer in the model's parameter order, as ``model.parameters()``
gives them). Such a checkpoint restores into the whole model (one process, DDP, FSDP2) at any
world size, and into pipeline stages.

Scope: stages with no other dimension (``pipeline = world size``); a pipeline over data-parallel
or tensor ranks (whose stages are DTensors over part of the ranks) is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from faccel._checkpoint._strategies._base import ExportKind, Ownership, Whole
from faccel._checkpoint._strategies._plain import PlainState
from faccel._loop._model import unwrap_model
from faccel._marks import WRITTEN_BY
from faccel.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    from faccel._dist._state import DistState

__all__ = ["PipelineState"]


def _pipelined(model: object) -> Any:
    from faccel._loop._pipeline import PipelinedModel

    return model if isinstance(model, PipelinedModel) else None


def _unbuilt(model: Any) -> str:
    return (
        "the PipelinedModel's stages are not built yet (they are built at the first "
        "forward_backward, from a batch's shapes), so there is nothing to checkpoint or restore into: "
        "pass prepare(..., example=batch) (this rank's batch, as forward_backward gets it) to build "
        "the stages at prepare"
    )


def _check(model: Any) -> None:
    if not model.built:
        raise UsageError(_unbuilt(model))
    layout = model._dist.parallel
    if layout.data_size * layout.context * layout.tensor > 1:
        msg = (
            f"checkpoints of pipeline stages over data-parallel, context or tensor ranks (layout "
            f"{layout}) are not supported: each stage's tensors are DTensors over part of the ranks. "
            "Checkpoints work with pipeline equal to the world size; save the stages yourself otherwise"
        )
        raise CheckpointError(msg)


def _stage_state(model: Any) -> dict[str, torch.Tensor]:
    """This rank's stages' state dicts, by the model's own names."""
    out: dict[str, torch.Tensor] = {}
    for stage in model.stages:
        out.update(unwrap_model(stage).state_dict())
    return out


def _param_names(model: Any) -> dict[int, str]:
    """id(parameter this rank trains) -> its name in the model."""
    return {
        id(param): name for stage in model.stages for name, param in unwrap_model(stage).named_parameters()
    }


def _spec(value: torch.Tensor) -> list[Any]:
    return [str(value.dtype).removeprefix("torch."), list(value.shape)]


def _exchange(dist: DistState, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``mine`` (JSON: names, shapes, numbers), in rank order: no pickle, no tensor data."""
    from faccel._dist._collectives import all_gather_bytes
    from faccel._dist._process_group import comm_device

    payload = json.dumps(mine, separators=(",", ":")).encode()
    device = comm_device(dist)
    raw = all_gather_bytes(payload, 4096, device, dist.world_size)
    lengths = [int.from_bytes(r[:4], "little") for r in raw]
    if max(lengths) > 4092:
        raw = all_gather_bytes(payload, max(lengths) + 4, device, dist.world_size)
    return [json.loads(r[4 : 4 + n]) for r, n in zip(raw, lengths, strict=True)]


def _meta(spec: list[Any], rank: int) -> torch.Tensor:
    tensor = torch.empty(spec[1], dtype=getattr(torch, spec[0]), device="meta")
    setattr(tensor, WRITTEN_BY, rank)
    return tensor


def stage_shards(model: Any, optimizer: Any) -> Whole:
    """The whole model's state (and optimizer's, numbered as the whole model's), this rank's tensors
    real and every other stage's a ``meta`` tensor marked with the rank that writes it. A collective."""
    dist = model._dist
    own = _stage_state(model)
    order = [name for name, _ in model._source.named_parameters()]
    position = {name: i for i, name in enumerate(order)}
    local: dict[str, Any] = {"model": {k: _spec(v) for k, v in own.items()}, "groups": [], "state": {}}
    saved = optimizer.state_dict() if optimizer is not None else None
    names = _param_names(model)
    if saved is not None:
        for group, live in zip(saved["param_groups"], optimizer.param_groups, strict=True):
            ids = [names[id(p)] for p in live["params"]]
            local["groups"].append(ids)
            for number, name in zip(group["params"], ids, strict=True):
                entry = saved["state"].get(number)
                if entry is None:
                    continue
                local["state"][name] = {
                    k: (["T", *_spec(v)] if isinstance(v, torch.Tensor) else ["V", v])
                    for k, v in entry.items()
                }
    every = _exchange(dist, local)
    writer = {name: rank for rank, each in enumerate(every) for name in each["model"]}
    source = model._source.state_dict()
    model_state: dict[str, torch.Tensor] = {}
    for name in source:
        if name in own:
            model_state[name] = own[name]
        elif name in writer:
            model_state[name] = _meta(every[writer[name]]["model"][name], writer[name])
    missing = sorted(set(source) - set(model_state))
    if missing:
        msg = f"no pipeline stage holds {missing[:5]} of the model: cannot checkpoint a model the stages do not cover"
        raise CheckpointError(msg)
    if saved is None:
        return model_state, None
    # The whole optimizer's groups: each group's parameters of every stage, in the model's order.
    groups, state, number = [], {}, 0
    for g, group in enumerate(saved["param_groups"]):
        members = sorted({n for each in every for n in each["groups"][g]}, key=lambda n: position[n])
        ids = []
        for name in members:
            ids.append(number)
            holder = next(r for r, each in enumerate(every) if name in each["groups"][g])
            entry = every[holder]["state"].get(name)
            if entry is not None:
                mine = holder == dist.rank
                live = saved["state"][_local_number(saved, optimizer, names, name)] if mine else None
                state[number] = {
                    k: (live[k] if mine else (_meta(v[1:], holder) if v[0] == "T" else v[1]))
                    for k, v in entry.items()
                }
            number += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return model_state, {"state": state, "param_groups": groups}


def _local_number(saved: Mapping[str, Any], optimizer: Any, names: Mapping[int, str], name: str) -> int:
    for group, live in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        for number, param in zip(group["params"], live["params"], strict=True):
            if names[id(param)] == name:
                return int(number)
    raise KeyError(name)


class PipelineState(PlainState):
    """The strategy state of a :class:`PipelinedModel` (see the module's docstring)."""

    name = "pipeline"
    staged = frozenset({"model", "optimizer"})

    def holds(self, model: object) -> bool:
        """A ``PipelinedModel``."""
        return _pipelined(model) is not None

    def whole_state(self, dist: DistState, model: Any, optimizer: Any) -> Whole | None:
        """Refused: no rank gathers the stages (the sharded format is the pipeline's)."""
        msg = (
            "checkpoint(..., sharded=False) of a PipelinedModel: whole tensors would gather every stage "
            "onto rank 0; pipeline stages checkpoint in the sharded format (sharded=None or True)"
        )
        raise CheckpointError(msg)

    def shard_state(self, model: Any, optimizer: Any) -> Whole | None:
        """Every name of the model, this rank's tensors real, the others' ``meta`` (a collective)."""
        _check(model)
        return stage_shards(model, optimizer)

    def sharded_problem(self, dist: DistState, model: object) -> str | None:
        """Stages not built yet."""
        return None if _pipelined(model).built else _unbuilt(model)

    def shards_by_default(self, dist: DistState, model: object) -> bool:
        """Always the sharded format."""
        return True

    def target(self, model: object) -> dict[str, torch.Tensor]:
        """This rank's stages' tensors, by the model's names."""
        _check(model)
        return _stage_state(model)

    def ownership(self, model: object) -> Ownership:
        """The names of this rank's stages, each whole."""
        _check(model)
        return Ownership(names=frozenset(_stage_state(model)))

    def export_kind(self, model: object) -> ExportKind:
        """Every rank its stages (not yet supported: refused where asked)."""
        return "spread"

    def gather_named(self, model: object, names: Sequence[str], *, keep: bool) -> dict[str, torch.Tensor]:
        """Refused: save_model of a pipelined model is not supported."""
        msg = "save_model of a PipelinedModel is not supported yet: restore its checkpoint at pipeline=1 and export there"
        raise UsageError(msg)

    def load_weights(self, model: object, tensors: Mapping[str, torch.Tensor]) -> None:
        """Refused: load_model into a pipelined model is not supported."""
        msg = "load_model into a PipelinedModel is not supported yet: load at pipeline=1, checkpoint, restore"
        raise UsageError(msg)
