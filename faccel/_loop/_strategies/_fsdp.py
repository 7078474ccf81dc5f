"""FSDP2's room: ``fully_shard`` on each unit of the model, then on its root (``strategy='fsdp'``).

Each unit's parameters become DTensors sharded over the ranks (or over a mesh's data-parallel
dimensions, where the DeviceMesh's room and pipeline stages call :func:`wrap_fsdp`); a
meta-built model is sharded first and only this rank's shards are allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from faccel._dist._state import DistState
from faccel._loop._check_in import add_check_in
from faccel._loop._model import is_sharded, peel
from faccel._loop._options import PrepareOptions
from faccel._loop._strategies._base import LoopStrategy
from faccel._loop._strategies._experts._dispatch import expert_units, experts_mesh
from faccel._loop._ties import check_ties_in_units, ties_in_one_unit

__all__ = ["FsdpStrategy", "default_shard_policy", "wrap_fsdp"]


class FsdpStrategy(LoopStrategy):
    """``strategy='fsdp'`` over peer processes, every rank one shard (no mesh).

    Example:
        >>> import faccel
        >>> FsdpStrategy().shards_first(faccel.DistState(strategy="fsdp"))
        True
    """

    name = "fsdp"

    def applies(self, dist: DistState) -> bool:
        """Peer processes under ``strategy='fsdp'`` (a layout on the mesh was taken by the row above)."""
        return dist.distributed and dist.strategy == "fsdp"

    def holds(self, model: object, params: Sequence[torch.Tensor] = ()) -> bool:
        """A model whose parameters FSDP2 or tensor parallelism made DTensors."""
        return isinstance(model, nn.Module) and is_sharded(peel(model))

    def wrap(self, dist: DistState, model: nn.Module, options: PrepareOptions) -> nn.Module:
        """Each unit, then the root, through ``fully_shard``."""
        return wrap_fsdp(dist, model, options)

    def shards_first(self, dist: DistState) -> bool:
        """A meta-built model is sharded, then only this rank's part allocated."""
        return True

    def replaces_parameters(self, dist: DistState) -> bool:
        """``fully_shard`` replaces each parameter by a DTensor."""
        return True


ShardPolicy = Callable[[nn.Module], bool]


def default_shard_policy(root: nn.Module) -> ShardPolicy:
    """Shard each block of the first ``ModuleList`` (transformer layers), else each child.

    Each block becomes one FSDP2 unit: its parameters are gathered just before
    its forward and freed after, which is what bounds the peak memory. A
    module that shares a parameter with one outside it (a tied embedding and
    head) is left to the unit around both, so the tied tensor is sharded once.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> default_shard_policy(net)(net[0]), default_shard_policy(net)(net[1])
        (True, False)
    """
    blocks = next((m for m in root.modules() if isinstance(m, nn.ModuleList)), None)
    units = {id(m) for m in (blocks if blocks is not None else root.children())}
    return ties_in_one_unit(
        root, lambda module: id(module) in units and any(True for _ in module.parameters())
    )


def wrap_fsdp(dist: DistState, model: nn.Module, options: PrepareOptions, mesh: Any = None) -> nn.Module:
    """``model`` sharded by FSDP2 over ``mesh`` (every rank without one); one process: autocast only."""
    if not dist.distributed:
        return LoopStrategy().wrap(dist, model, options)  # one process: nothing to shard over
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # CPU offload: sharded parameters (and their gradients) live on the CPU, each unit copied to the
    # device for its forward and backward; pinned memory only where there is a device to copy to.
    offload = (
        CPUOffloadPolicy(pin_memory=dist.device.type == "cuda")
        if options.offload == "cpu"
        else OffloadPolicy()
    )
    reshard = options.reshard_after_forward
    dtype = dist.autocast_dtype
    # FSDP2 casts parameters itself (and all-reduces in float32), so no autocast layer.
    reduce_dtype = torch.float32 if dtype is not None else None
    inner = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    # Float32 outputs from the root only: a block that returned float32 would hand the root's
    # own layers (a read-out after the blocks, in low precision) an input of another dtype.
    root = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype, output_dtype=reduce_dtype)
    if options.shard_policy is not None:  # a tie split over two units: refused before anything is sharded
        check_ties_in_units(model, options.shard_policy)
    should_shard = options.shard_policy or default_shard_policy(model)
    # Split experts (expert parallelism beside shard): their own units over the shard ranks first.
    for experts in expert_units(dist, model):
        fully_shard(
            experts,
            mesh=experts_mesh(dist),
            mp_policy=inner,
            reshard_after_forward=reshard,
            offload_policy=offload,
        )
    # Innermost first: fully_shard on a parent skips parameters its children already own.
    for module in reversed(list(model.modules())):
        if module is not model and should_shard(module):
            fully_shard(
                module, mesh=mesh, mp_policy=inner, reshard_after_forward=reshard, offload_policy=offload
            )
    fully_shard(model, mesh=mesh, mp_policy=root, reshard_after_forward=reshard, offload_policy=offload)
    add_check_in(dist, model, sharding="FSDP2")  # a forward on some ranks only: a named error
    return model
