"""Expert parallelism at ``prepare``: each rank keeps its block of every experts module, and their
forward sends each token to its experts' ranks and back.

``shard_experts`` replaces, in each experts module (``faccel._loop._strategies._experts._find``),
every stacked parameter by this rank's rows of it (experts ``r * E / R`` to
``(r + 1) * E / R - 1`` of the ``R`` ranks of its expert group), under the
same name, as a DTensor ``Shard(0)`` over the mesh's ``"expert"`` dimension:
``state_dict`` keys do not change, each holds the whole shape and this rank's
rows, and checkpoints and exports gather and scatter it as any DTensor faccel
made (the model is marked as tensor parallelism marks it). Its forward becomes
the dispatch, one instance attribute (``forward``, as activation checkpointing
sets; faccel._marks):

1. the plan (``_plan.dispatch_plan``): assignments by expert, rows per rank;
2. ``all_to_all_single`` of the counts, then of the tokens (uneven splits),
   over the expert group's own process group (never the default one, where
   DDP's gradient all-reduces run in an order of their own);
3. the module's own forward, on a view that holds this rank's experts only,
   over the rows each local expert received (every source rank's rows in rank
   order, each with weight 1, so each row comes back as its expert's output);
4. the reverse all-to-all, the rows back in their places, and the combine:
   each token's outputs, weighted by the router, summed in increasing expert
   order from zero, as transformers' loop over experts sums them (so one
   process and an expert group add the same numbers in the same order).

The gradient of an expert's weights sums every rank's tokens' gradients (the
all-to-all's backward brings them); the view scales it by ``1 / R`` on the way,
so that it is the mean over the data-parallel ranks that DDP takes of every
other parameter. The per-step load (tokens routed to each expert, drops) is
kept in ``dist.runtime`` for :func:`faccel.expert_load`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as tdist
from torch import nn

from faccel._dist._mesh import device_mesh, dimension_group
from faccel._dist._state import DistState
from faccel._loop._options import PrepareOptions
from faccel._loop._strategies._experts._find import find_experts
from faccel._loop._strategies._experts._plan import capacity_of, dispatch_plan, receive_plan
from faccel._marks import EXPERT_SHARD, TENSOR_PARALLEL
from faccel._torch_compat import ddp_ignore, dtensor_local, is_dtensor, like_dtensor
from faccel.errors import DistributedError, PrepareError

__all__ = [
    "ExpertShard",
    "expert_shards",
    "expert_units",
    "experts_mesh",
    "ignore_experts_in_ddp",
    "shard_experts",
    "split_experts",
]


@attrs.frozen(kw_only=True)
class ExpertShard:
    """What an experts module's dispatch needs: where it is, its group, this rank's block.

    Attributes:
        name: The module's name in the model.
        num_experts: Experts in the layer (every rank's).
        ranks: The expert group's size.
        index: This rank's place in its expert group.
        capacity_factor: Each expert's capacity, a multiple of its even share; None: dropless.
        slot_major: Each expert's rows by slot, then token (transformers' eager loop), or by
            token (its ``grouped_mm`` and ``batched_mm`` forwards): the order the module's own
            forward would give them in one process, so its weight gradients sum alike.
    """

    name: str
    num_experts: int
    ranks: int
    index: int
    capacity_factor: float | None = None
    slot_major: bool = True

    @property
    def local(self) -> int:
        """Experts this rank holds."""
        return self.num_experts // self.ranks

    @property
    def first(self) -> int:
        """The first expert this rank holds."""
        return self.index * self.local


class _LocalRows(torch.autograd.Function):
    """A split parameter's rows on this rank for the module's own forward; its gradient times ``scale``.

    Of a DTensor, its local tensor, and backward a gradient of the DTensor's own
    placement, as ``to_local`` gives it; of a plain tensor (FSDP2's unsharded one), the
    tensor. One node where ``to_local`` then a scaling made two, each a Python call
    in every backward, and the gradient's DTensor built without ``from_local``.
    """

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        local, spec = dtensor_local(param) if is_dtensor(param) else (param, None)
        ctx.scale, ctx.spec, ctx.stride = scale, spec, local.stride()
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad * ctx.scale
        if ctx.spec is None:
            return grad, None
        if grad.stride() != ctx.stride:  # the spec describes the local part's layout: give it that
            grad = grad.new_empty_strided(grad.shape, ctx.stride).copy_(grad)
        return like_dtensor(grad, ctx.spec), None


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward is the reverse all-to-all.

    (torch's ``torch.distributed.nn.functional.all_to_all_single`` does the same, but its
    errors could not be named here; this one reports a lost peer as the layer's error.)
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, where: str
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.where = (out_splits, in_splits), group, where
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        _exchange(out, rows.contiguous(), out_splits, in_splits, group, where)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        _exchange(back, grad.contiguous(), in_splits, out_splits, ctx.group, ctx.where + " (backward)")
        return back, None, None, None, None


def _exchange(
    out: torch.Tensor, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, where: str
) -> None:
    if group is None:  # an expert group of one: every expert here
        out.copy_(rows)
        return
    try:
        tdist.all_to_all_single(out, rows, out_splits, in_splits, group=group)
    except RuntimeError as error:  # gloo's report of a lost or silent peer
        peers = tdist.get_process_group_ranks(group)
        msg = (
            f"the all-to-all of experts module {where} on rank {tdist.get_rank()} failed: another rank of "
            f"its expert group {peers} crashed or did not reach it within the timeout (set with "
            f"faccel.detect(timeout=...) or FACCEL_TIMEOUT); that rank's log holds the first error. "
            f"torch said: {error}"
        )
        raise DistributedError(msg) from error


def _local_view(module: nn.Module, kind: type, shard: ExpertShard) -> nn.Module:
    """A shallow copy of ``module`` (of its own class ``kind``, whatever FSDP2 made of it) whose
    stacked parameters are this rank's, their gradients scaled by ``1 / ranks``.

    The module's own forward runs on it as on ``module`` with ``num_experts`` local experts.
    (Made without ``__init__``: FSDP2's class would run it again, transformers' needs a config.)
    With every expert here (one rank) the parameters are the module's own, unscaled.
    """
    view: nn.Module = object.__new__(kind)
    view.__dict__.update(module.__dict__)
    if shard.ranks > 1:
        scale = 1.0 / shard.ranks
        own = {name: _LocalRows.apply(param, scale) for name, param in module.named_parameters(recurse=False)}
        view.__dict__["_parameters"] = own  # nn.Module reads its parameters from this dict
    view.__dict__["num_experts"] = shard.local
    return view


def _dispatched(
    kind: type, module: nn.Module, original: Any, shard: ExpertShard, group: Any, loads: dict[str, Any]
) -> Any:
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        if is_dtensor(hidden_states):
            msg = (
                f"experts module {shard.name} got a DTensor of hidden states (a tensor-parallel plan "
                "left its input split, e.g. sequence parallel); its dispatch moves whole tokens: give "
                "the block a plain (replicated) input, e.g. PrepareModuleInput(desired_input_layouts="
                "Replicate(), use_local_output=True)"
            )
            raise DistributedError(msg)
        tokens, top_k = top_k_index.shape
        capacity = capacity_of(tokens, top_k, shard.num_experts, shard.capacity_factor)
        plan = dispatch_plan(
            top_k_index,
            num_experts=shard.num_experts,
            ranks=shard.ranks,
            capacity=capacity,
            slot_major=shard.slot_major,
        )
        loads[shard.name] = (plan.routed, plan.dropped)
        cells_in = torch.empty_like(plan.cells)
        _exchange(
            cells_in,
            plan.cells,
            [shard.local] * shard.ranks,
            [shard.local] * shard.ranks,
            group,
            shard.name,
        )
        receive = receive_plan(cells_in.view(shard.ranks, shard.local, top_k), slot_major=shard.slot_major)
        device = hidden_states.device
        order = plan.order.to(device)
        sent = hidden_states[order // top_k]
        arrived = _AllToAll.apply(sent, receive.recv_splits, plan.send_splits, group, shard.name)
        by_expert = receive.order.to(device)
        grouped = arrived[by_expert]
        ids = receive.experts.to(device)
        ones = torch.ones(ids.numel(), 1, dtype=top_k_weights.dtype, device=device)
        computed = original(_local_view(module, kind, shard), grouped, ids[:, None], ones)
        if torch.is_grad_enabled() and grouped.requires_grad and not computed.requires_grad:
            # no rows for this rank's experts: still a node of the graph, so that its reverse
            # all-to-all runs in the backward as every peer's does
            computed = computed + grouped * 0
        # the rows back in arrival order (the inverse of by_expert, by one index_copy)
        returned = torch.empty_like(computed).index_copy(0, by_expert, computed)
        back = _AllToAll.apply(returned, plan.send_splits, receive.recv_splits, group, shard.name)
        # Each assignment lands in its token's row at the place of its expert among the token's
        # experts (increasing id, ties by slot), so the sum below adds each token's outputs in
        # increasing expert order from zero, as transformers' loop over experts does.
        slots = torch.sort(top_k_index, dim=1, stable=True).indices.to(device)
        place = torch.empty_like(slots).scatter_(1, slots, _slot_ids(slots))
        place = (place + torch.arange(0, tokens * top_k, top_k, device=device)[:, None]).view(-1)
        fresh = hidden_states.new_empty if plan.dropped == 0 else hidden_states.new_zeros  # drops: zeros
        rows = fresh((tokens * top_k, hidden_states.shape[-1])).index_copy(
            0, place[order], back.to(hidden_states.dtype)
        )
        weights = top_k_weights.gather(1, slots)
        out = torch.zeros_like(hidden_states)
        for row, weight in zip(rows.view(tokens, top_k, -1).unbind(1), weights.unbind(1), strict=True):
            out = out + row * weight[:, None]
        return out

    return forward


def _slot_ids(slots: torch.Tensor) -> torch.Tensor:
    """``[0, 1, ..., k - 1]`` on every row of ``slots`` (``[T, k]``), a broadcast view."""
    return torch.arange(slots.shape[1], device=slots.device).expand_as(slots)


def shard_experts(
    dist: DistState, model: nn.Module, *, names: Sequence[str] | None, capacity_factor: float | None
) -> dict[str, ExpertShard]:
    """Keep this rank's experts of each experts module of ``model`` and give each the dispatch forward.

    Parameters are replaced (same names, this rank's rows); the caller points
    optimizers at the new ones (``REPLACED_BY``). A collective (the expert
    group is made from the mesh): every rank calls it.

    Raises:
        PrepareError: No experts module, one that breaks the contract, or a layout
            expert parallelism does not run under (yet).
    """
    layout = dist.parallel
    # Under FSDP2 the experts compose with every data and model dimension but context: pipeline
    # stages split their own blocks' experts, tensor ranks hold the same tokens and experts, and the
    # experts' units shard over shard (x replicate, HSDP) while the rest shards over every data rank.
    # DDP leaves the experts' parameters alone (each rank's differ), so it cannot average them over
    # replicas: with DDP the expert ranks are every rank.
    under_fsdp = ("expert", "shard", "pipeline", "tensor", "replicate")
    beside = under_fsdp if dist.strategy == "fsdp" else ("expert",)
    others = {name: size for name, size in layout.sizes.items() if name not in beside and size > 1}
    if layout.expert > 1 and (others or dist.strategy not in ("ddp", "fsdp")):
        msg = (
            f"layout {layout} combines expert parallelism with {sorted(others) or dist.strategy!r}; faccel "
            "splits experts over expert ranks alone (Layout(expert=E), strategy 'ddp') or, under "
            "strategy 'fsdp', beside shards, replicas, pipeline stages and tensor ranks (not context "
            "ranks yet); use one of those"
        )
        raise PrepareError(msg)
    group = dimension_group(dist, "expert") if layout.expert > 1 else None
    index = layout.coordinate("expert", dist.rank)
    loads = dist.runtime.expert_loads
    shards = {}
    for name, module in find_experts(model, names).items():
        count = int(module.num_experts)  # type: ignore[arg-type]
        if count % layout.expert:
            msg = (
                f"experts module {name!r} holds {count} experts, which Layout(expert={layout.expert}) cannot "
                f"split in equal blocks; choose an expert size that divides {count}"
            )
            raise PrepareError(msg)
        config = getattr(module, "config", None)
        kind = getattr(config, "_experts_implementation", None)
        shard = ExpertShard(
            name=name,
            num_experts=count,
            ranks=layout.expert,
            index=index,
            capacity_factor=capacity_factor,
            slot_major=kind in (None, "eager"),
        )
        for pname, param in list(module.named_parameters(recurse=False)):
            if shard.ranks == 1:
                break  # every expert here: the parameters stay as they are
            mine = param.detach()[shard.first : shard.first + shard.local].clone()
            setattr(module, pname, nn.Parameter(_on_mesh(dist, mine), requires_grad=param.requires_grad))
        original = type(module).forward
        object.__setattr__(
            module, "forward", _dispatched(type(module), module, original, shard, group, loads)
        )
        object.__setattr__(module, EXPERT_SHARD, shard)
        shards[name] = shard
    if shards and layout.expert > 1:
        # checkpoints, restores and exports treat the model as one of DTensors faccel made (faccel._marks)
        object.__setattr__(model, TENSOR_PARALLEL, True)
    return shards


def _on_mesh(dist: DistState, rows: torch.Tensor) -> Any:
    """This rank's block of a stacked parameter as a DTensor: ``Shard(0)`` over the expert dimension.

    The whole tensor is then what DTensor says it is: checkpoints gather and scatter it (the
    whole-tensor format, any layout on restore), ``save_model`` writes it whole under its own name,
    as for tensor parallelism's DTensors.
    """
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(rows, device_mesh(dist)["expert"], [Shard(0)], run_check=False)


def split_experts(dist: DistState, model: nn.Module, options: PrepareOptions) -> None:
    """``prepare``'s step for expert parallelism: where the layout has expert ranks, or the options
    name experts or a capacity, split ``model``'s experts (:func:`shard_experts`); else nothing.

    In one process (or ``expert=1``) the dispatch runs with every expert here and no
    all-to-all, so the same options give the same forward (capacity, load counts) at any size.
    """
    asked = options.experts is not None or options.expert_capacity is not None
    if not (asked or (dist.distributed and dist.parallel.expert > 1)):
        return
    if any(EXPERT_SHARD in module.__dict__ for module in model.modules()):
        return  # split by an earlier prepare
    shard_experts(dist, model, names=options.experts, capacity_factor=options.expert_capacity)


def expert_shards(model: nn.Module) -> dict[str, ExpertShard]:
    """The experts modules of ``model`` that expert parallelism split, by name, and their shards.

    Example:
        >>> import torch
        >>> expert_shards(torch.nn.Linear(2, 2))
        {}
    """
    return {
        name: module.__dict__[EXPERT_SHARD]
        for name, module in model.named_modules()
        if EXPERT_SHARD in module.__dict__
    }


def expert_units(dist: DistState, model: nn.Module) -> list[nn.Module]:
    """The split experts modules that FSDP2 shards on their own, over the ``shard`` ranks.

    Beside ``shard > 1`` (torchtitan's ``dp_shard`` x ``ep``) each rank's block of
    experts is sharded again over the ranks that hold the same block, while the
    rest of the model is sharded over every data-parallel rank; the experts'
    gradients are averaged over the shard ranks by FSDP2 and over the expert
    group by the dispatch's ``1 / E``. With ``shard=1`` (pipeline stages beside
    experts) each is still its own unit, of one rank: so that the unit around
    the rest, over every data-parallel rank, leaves the experts' blocks (which
    differ by rank) alone.
    """
    if dist.parallel.expert == 1:
        return []
    return [
        module
        for module in model.modules()
        if EXPERT_SHARD in module.__dict__ and module.__dict__[EXPERT_SHARD].ranks > 1
    ]


def experts_mesh(dist: DistState) -> Any:
    """The mesh an experts module's FSDP2 unit shards over: ``shard``, with replicas HSDP over
    ``("replicate", "shard")`` (each block averaged over the replicas that hold it too)."""
    mesh = device_mesh(dist)
    return mesh["replicate", "shard"] if dist.parallel.replicate > 1 else mesh["shard"]


def ignore_experts_in_ddp(wrapped: nn.Module) -> None:
    """Make the DDP built next around ``wrapped`` leave the split experts' parameters alone.

    They differ by rank: DDP must neither broadcast rank 0's nor average them
    (their gradients already hold every rank's tokens, scaled by the dispatch).
    """
    ids = {
        id(param)
        for module in wrapped.modules()
        if EXPERT_SHARD in module.__dict__ and module.__dict__[EXPERT_SHARD].ranks > 1
        for param in module.parameters(recurse=False)
    }
    if ids:
        ddp_ignore(wrapped, [name for name, param in wrapped.named_parameters() if id(param) in ids])
