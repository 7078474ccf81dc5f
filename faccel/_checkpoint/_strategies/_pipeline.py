"""Pipeline stages: the strategy state of a
:class:`~faccel._loop._strategies._pipeline._stages.PipelinedModel`.

A stage's rank holds only its stages' names. A checkpoint of it is the sharded format (version 2),
keyed by the original model's names, exactly as an unpipelined model's: every rank plans the whole
model's index (the names of every stage, learned in one small exchange of names and shapes, no
tensor data), and each tensor is written whole by the rank that holds it (its chunk rule's
``first`` is that rank: the index records which rank wrote each name). The optimizer state is
numbered as the whole model's optimizer numbers it: each group's parameters in the model's order
(the groups given to the optimizer in the model's parameter order, as ``model.parameters()``
gives them). Such a checkpoint restores into the whole model (one process, DDP, FSDP2) at any
world size, and into pipeline stages.

Within a stage of several ranks (``pipeline < world size``: data-parallel, context or tensor ranks
in each stage's block of consecutive ranks), the stage's tensors are cut into chunks of rows, one
per rank of the block (``Held``: the chunk rule ``block = ceil(rows / ranks)``, ``first`` = the
block's first rank), and each rank writes only its own chunk: an FSDP2 shard over the block as it
is held, any other DTensor made whole one tensor at a time and cut. A restore reads, on each rank,
only its stages' names (and of a row shard, its rows).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from faccel._checkpoint._sharded._chunks import Held, rows_of, split_by_rows
from faccel._checkpoint._strategies._base import ExportKind, Ownership, Whole
from faccel._checkpoint._strategies._plain import PlainState
from faccel._loop._strategies import unwrap_model
from faccel._marks import OTHER_STAGE, REPLACED_BY, WHOLE_GROUPS, WRITTEN_BY
from faccel._torch_compat import is_dtensor, local_rows
from faccel.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    from faccel._dist._state import DistState

__all__ = ["PipelineState"]


def _pipelined(model: object) -> Any:
    from faccel._loop._strategies._pipeline._stages import PipelinedModel

    return model if isinstance(model, PipelinedModel) else None


def _unbuilt(model: Any) -> str:
    return (
        "the PipelinedModel's stages are not built yet (they are built at the first "
        "forward_backward, from a batch's shapes), so there is nothing to checkpoint, restore or "
        "load_model into: pass prepare(..., example=batch) (this rank's batch, as forward_backward "
        "gets it) to build the stages at prepare"
    )


def _check(model: Any) -> None:
    if not model.built:
        raise UsageError(_unbuilt(model))


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


def _block(dist: DistState) -> tuple[int, int]:
    """``(first, ranks)``: the consecutive ranks that hold this rank's stages (pipeline is outermost)."""
    layout = dist.parallel
    ranks = dist.world_size // layout.pipeline
    return layout.coordinate("pipeline", dist.rank) * ranks, ranks


def _rule(shape: tuple[int, ...] | list[int], ranks: int) -> int:
    """Rows per chunk of a stage's tensor over its ``ranks``: as ``torch.chunk`` (FSDP2) splits it."""
    return max(1, -(-rows_of(tuple(shape)) // ranks))


def _meta(spec: list[Any], first: int, ranks: int) -> torch.Tensor:
    """Another stage's tensor in the plan: its shape, and the chunk rule of the ranks that write it."""
    tensor = torch.empty(spec[1], dtype=getattr(torch, spec[0]), device="meta")
    setattr(tensor, WRITTEN_BY, Held(block=_rule(spec[1], ranks), first=first, ranks=ranks))
    return tensor


def _own(tensor: torch.Tensor, rank: int, first: int, ranks: int) -> torch.Tensor:
    """This rank's stage's tensor, marked with its chunk rule and how to get the chunk this rank writes.

    Within a stage of several ranks each writes its rows only: an FSDP2 shard over the block's
    ranks (``Shard(0)`` over ``first ... first + ranks - 1``) is that chunk as it is held; any other
    DTensor (tensor parallelism, HSDP replicas) is made whole (``full_tensor``, a collective of the
    stage's ranks, which all plan the same names in one order) and cut, one tensor at a time, when
    a checkpoint's plan asks for it (an export gathers its own way and never does).
    """
    held = Held(block=_rule(tuple(tensor.shape), ranks), first=first, ranks=ranks)
    rows = held.chunk_of(rank, rows=rows_of(tuple(tensor.shape)))
    out = tensor.detach()
    setattr(out, WRITTEN_BY, attrs.evolve(held, cut=lambda: _cut(out, rows, first, ranks)))
    return out


def _cut(tensor: torch.Tensor, rows: tuple[int, int] | None, first: int, ranks: int) -> torch.Tensor | None:
    """The rows ``rows`` of this stage's ``tensor`` (None: none), gathered first unless held as they are."""
    piece: torch.Tensor | None = None
    with torch.no_grad():
        if is_dtensor(tensor):
            mesh = tensor.device_mesh.mesh.flatten().tolist()  # type: ignore[attr-defined]
            if split_by_rows(tensor) and mesh == list(range(first, first + ranks)):
                local = tensor.to_local().detach()  # type: ignore[attr-defined]
                piece = local if rows is not None else None
            else:
                whole = tensor.full_tensor()  # type: ignore[attr-defined]
                if rows is not None:
                    piece = whole.clone() if whole.dim() == 0 else whole[rows[0] : rows[1]].clone()
                del whole
        elif rows is not None:
            piece = tensor if tensor.dim() == 0 else tensor[rows[0] : rows[1]]
    if piece is not None and rows is not None and rows_of(tuple(piece.shape)) != rows[1] - rows[0]:
        msg = f"this rank's part of a stage's tensor has {piece.shape[0]} rows, not rows {rows}"
        raise CheckpointError(msg)
    return piece


def _entry(live: Any, key: str, spec: list[Any], rank: int, holder: int, ranks: int) -> Any:
    """One value of an optimizer state: this rank's stage's (``live``) marked, or another's stand-in."""
    if spec[0] != "T":
        return live[key] if live is not None else spec[1]
    return _own(live[key], rank, holder, ranks) if live is not None else _meta(spec[1:], holder, ranks)


def stage_shards(model: Any, optimizer: Any) -> Whole:
    """The whole model's state (and optimizer's, numbered as the whole model's): this rank's stages'
    tensors live, every other stage's a ``meta`` tensor, each marked (``Held``) with the ranks that
    write its chunks (the ranks of its stage, each its own rows) and, here, this rank's chunk.
    A collective."""
    dist = model._dist
    first, ranks = _block(dist)
    own = _stage_state(model)
    local: dict[str, Any] = {"model": {k: _spec(v) for k, v in own.items()}, "state": {}}
    saved = optimizer.state_dict() if optimizer is not None else None
    names = _param_names(model)
    if saved is not None:
        for group, live in zip(saved["param_groups"], optimizer.param_groups, strict=True):
            mine = [names[id(p)] for p in live["params"]]
            for number, name in zip(group["params"], mine, strict=True):
                entry = saved["state"].get(number)
                if entry is None:
                    continue
                local["state"][name] = {
                    k: (["T", *_spec(v)] if isinstance(v, torch.Tensor) else ["V", v])
                    for k, v in entry.items()
                }
    every = _exchange(dist, local)
    writer: dict[str, int] = {}
    for rank, each in enumerate(every):  # the first rank of each stage's block
        for name in each["model"]:
            writer.setdefault(name, rank)
    source = model._source.state_dict()
    model_state: dict[str, torch.Tensor] = {}
    for name in source:
        if name in own:
            model_state[name] = _own(own[name], dist.rank, first, ranks)
        elif name in writer:
            model_state[name] = _meta(every[writer[name]]["model"][name], writer[name], ranks)
    missing = sorted(set(source) - set(model_state))
    if missing:
        msg = f"no pipeline stage holds {missing[:5]} of the model: the stages do not cover it"
        raise CheckpointError(msg)
    if saved is None:
        return model_state, None
    # The whole optimizer's groups: every stage's parameters, as the optimizer was given them.
    whole = whole_groups(optimizer)
    named = {id(p): n for n, p in model._source.named_parameters()} | names
    holders: dict[str, int] = {}
    for rank, each in enumerate(every):
        for name in each["state"]:
            holders.setdefault(name, rank)
    local_of = {
        names[id(p)]: i
        for g, live in zip(saved["param_groups"], optimizer.param_groups, strict=True)
        for i, p in zip(g["params"], live["params"], strict=True)
    }
    groups, state, number = [], {}, 0
    for group, members in zip(saved["param_groups"], whole, strict=True):
        numbers: list[int] = []
        for param in members:
            name = named[id(param)]
            numbers.append(number)
            if name in holders:
                holder = holders[name]
                entry = every[holder]["state"][name]
                live = saved["state"][local_of[name]] if holder == first else None
                state[number] = {k: _entry(live, k, v, dist.rank, holder, ranks) for k, v in entry.items()}
            number += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
    return model_state, {"state": state, "param_groups": groups}


def whole_groups(optimizer: Any) -> list[list[torch.Tensor]]:
    """The optimizer's param groups as given, every stage's parameters (each as trained here where it is
    this rank's): how the whole model's optimizer numbers them."""
    recorded = getattr(optimizer, WHOLE_GROUPS, None)
    if recorded is None:
        return [list(group["params"]) for group in optimizer.param_groups]
    out = []
    for group in recorded:
        members = []
        for param in group:
            while getattr(param, REPLACED_BY, None) is not None:
                param = getattr(param, REPLACED_BY)
            members.append(param)
        out.append(members)
    return out


def _like(value: torch.Tensor, live: Any) -> torch.Tensor:
    """``value`` as ``live`` holds it: a whole tensor (the whole-tensor format, a plain save) kept by
    this rank's part where ``live`` is a DTensor (each rank keeps its own part, no communication)."""
    if not is_dtensor(live) or is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        value.to(live.to_local().device), live.device_mesh, live.placements, src_data_rank=None
    )


class PipelineState(PlainState):
    """The strategy state of a :class:`PipelinedModel` (see the module's docstring)."""

    name = "pipeline"
    # Loaded by load (each stage's own load_state_dict, the optimizer renumbered): nothing staged.
    staged: frozenset[str] = frozenset()

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

    def held(self, tensor: torch.Tensor) -> Held | None:
        """The stage's ranks and chunk rule that :meth:`shard_state` marked the tensor with."""
        return getattr(tensor, WRITTEN_BY, None)

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

    def owns_param(self, param: object) -> bool:
        """The state of this rank's stages' parameters; another stage's (marked at ``prepare``) is not."""
        return not getattr(param, OTHER_STAGE, False)

    def ownership(self, model: object) -> Ownership:
        """The names of this rank's stages; of an FSDP2 shard over the stage's ranks, its rows."""
        _check(model)
        state = _stage_state(model)
        return Ownership(
            names=frozenset(state),
            rows={name: local_rows(t) for name, t in state.items() if split_by_rows(t)},
            model_names=frozenset(_pipelined(model)._source.state_dict()),
        )

    def optimizer_view(self, optimizer: Any) -> tuple[list[dict[str, Any]], Any]:
        """The whole model's groups: every stage's parameters (another stage's marked as such)."""
        return [
            {**group, "params": members}
            for group, members in zip(optimizer.param_groups, whole_groups(optimizer), strict=True)
        ], optimizer

    def load(
        self,
        model: Any,
        optimizer: Any,
        model_state: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, Any] | None,
    ) -> bool:
        """This rank's names into its stages; the optimizer state of its parameters, renumbered."""
        _check(model)
        for stage in model.stages:
            module = unwrap_model(stage)
            live = module.state_dict()
            module.load_state_dict({k: _like(model_state[k], live[k]) for k in live}, strict=True)
        if optimizer is None or optimizer_state is None:
            return True
        local = optimizer.state_dict()
        number_of = {
            id(p): i
            for group, live in zip(local["param_groups"], optimizer.param_groups, strict=True)
            for i, p in zip(group["params"], live["params"], strict=True)
        }
        state, groups = {}, []
        for saved, live, members in zip(
            optimizer_state["param_groups"], local["param_groups"], whole_groups(optimizer), strict=True
        ):
            for number, param in zip(saved["params"], members, strict=True):
                if getattr(param, OTHER_STAGE, False) or id(param) not in number_of:
                    continue
                if number in optimizer_state["state"]:
                    state[number_of[id(param)]] = {
                        k: _like(v, param) if isinstance(v, torch.Tensor) and v.shape == param.shape else v
                        for k, v in optimizer_state["state"][number].items()
                    }
            groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": live["params"]})
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        return True

    def export_kind(self, model: object) -> ExportKind:
        """Every rank writes its stages' tensors (``shard_state``'s plan: another stage's are marked)."""
        _check(model)
        return "spread"

    def load_weights(self, model: object, tensors: Mapping[str, torch.Tensor]) -> None:
        """``load_model``'s tensors of this rank's stages (names checked before), each into its stage."""
        for stage in _pipelined(model).stages:
            module = unwrap_model(stage)
            own = {name: tensors[name] for name in module.state_dict() if name in tensors}
            if own:
                module.load_state_dict(own, strict=False)
