"""The DeviceMesh's loop strategy: tensor parallelism from the user's plan (``_tp_plan``), then FSDP2 over the
mesh's data-parallel dimensions (HSDP where there are replicas).

That order is PyTorch's (and torchtitan's): ``fully_shard`` then shards the tensor-parallel
DTensors again over the data-parallel dimensions (2-D parameters).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from faccel._dist._mesh import data_mesh
from faccel._dist._state import DistState
from faccel._loop._check_in import add_check_in
from faccel._loop._model import Autocast, is_sharded, peel
from faccel._loop._options import PrepareOptions
from faccel._loop._strategies._base import LoopStrategy, uses_mesh
from faccel._loop._strategies._fsdp import wrap_fsdp
from faccel._loop._strategies._mesh._tp_plan import apply_plan, plan_key_matches
from faccel._loop._ties import check_ties_in_plan
from faccel._marks import TENSOR_PARALLEL

__all__ = ["MeshStrategy"]


class MeshStrategy(LoopStrategy):
    """A layout on the DeviceMesh over peer processes: tensor parallelism, or FSDP2 with replicas (HSDP).

    Example:
        >>> import faccel
        >>> MeshStrategy().applies(faccel.DistState.simulated(world_size=2, layout=faccel.Layout(tensor=2)))
        False
    """

    name = "mesh"

    def applies(self, dist: DistState) -> bool:
        """Peer processes whose layout needs the DeviceMesh."""
        return dist.distributed and uses_mesh(dist)

    def holds(self, model: object, params: Sequence[torch.Tensor] = ()) -> bool:
        """A model whose parameters tensor parallelism (or FSDP2) made DTensors."""
        return isinstance(model, nn.Module) and is_sharded(peel(model))

    def wrap(self, dist: DistState, model: nn.Module, options: PrepareOptions) -> nn.Module:
        """Tensor parallelism from the plan first, then FSDP2 over the data-parallel part of the mesh."""
        layout = dist.parallel
        if layout.tensor > 1:
            if options.tp_plan is not None:  # a tied parameter split apart: refused before anything is split
                check_ties_in_plan(model, options.tp_plan, plan_key_matches)
            apply_plan(dist, model, options.tp_plan)
        if layout.data_size > 1:
            return wrap_fsdp(dist, model, options, mesh=data_mesh(dist))
        # Tensor parallelism alone: no data-parallel ranks to shard over or average with.
        object.__setattr__(model, TENSOR_PARALLEL, True)
        add_check_in(dist, model, sharding="tensor-parallel")  # as under FSDP2 (faccel._loop._check_in)
        if dist.autocast_dtype is not None:
            return Autocast(model, device_type=dist.device.type, dtype=dist.autocast_dtype)
        return model

    def shards_first(self, dist: DistState) -> bool:
        """A meta-built model is split and sharded, then only this rank's part allocated."""
        return True

    def replaces_parameters(self, dist: DistState) -> bool:
        """The plan and ``fully_shard`` replace parameters by DTensors."""
        return True
