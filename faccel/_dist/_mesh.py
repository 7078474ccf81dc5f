"""The DeviceMesh and process groups a :class:`~faccel.Layout` describes, made once per process group.

The mesh has every dimension of ``faccel._dist._layout.DIMENSIONS``, named,
sizes of 1 included (``("pipeline", "replicate", "shard", "expert", "context",
"tensor")``): ``device_mesh(dist)["tensor"]``, ``["pipeline"]`` and
``["replicate", "shard"]`` exist whatever the layout, so code written for one
layout runs on every other. (A dimension of size 1 costs one trivial group per
rank, made once.) Everything here reads the layout by dimension name.
Made lazily, because ``init_device_mesh`` is a collective every rank must
join and it costs a process group per dimension; kept in ``dist.runtime``
(the run's handle, see ``faccel._dist._runtime``) for the life of the default
process group, because a DTensor's mesh must be the very mesh the next call
slices from (``fully_shard`` over TP parameters checks that the two meshes
share a root). Use the states of one ``detect`` (``attrs.evolve`` keeps its
handle): a record made by another ``detect`` builds its own meshes.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as tdist

from faccel._dist._layout import DIMENSIONS
from faccel._dist._process_group import require_group
from faccel._dist._state import DistState
from faccel._torch_compat import flatten_mesh
from faccel._typecheck import setup_checked
from faccel.errors import DistributedError

__all__ = ["data_group", "data_mesh", "device_mesh", "dimension_group"]


def _cached(dist: DistState, key: tuple[Any, ...], make: Any) -> Any:
    """``make()``'s object for ``key`` (what, layout shape, device type), made once per default group.

    Held in ``dist.runtime.meshes`` with the default group it was made under:
    a new group (shutdown, then detect) makes an entry stale, and it is rebuilt.
    """
    world = tdist.group.WORLD
    made_here = dist.runtime.meshes
    held = made_here.get(key)
    if held is not None and held[0] is world:
        return held[1]
    made = make()
    made_here[key] = (world, made)
    return made


@setup_checked
def device_mesh(dist: DistState) -> Any:
    """The N-D DeviceMesh of ``dist.parallel``, one named dimension per layout dimension, made once.

    A collective the first time for each layout: every rank must call it.
    Slice it by name for PyTorch's own APIs: ``mesh["tensor"]`` for
    ``parallelize_module``, ``mesh["replicate", "shard"]`` for
    ``fully_shard`` (HSDP), ``mesh["pipeline"]`` for the pipeline stages.
    Rank ``r`` sits at ``dist.parallel.coordinates(r)``.

    Args:
        dist: The run's :class:`DistState`, with peer processes.

    Returns:
        A ``torch.distributed.device_mesh.DeviceMesh`` over ``dist.device``'s type.

    Raises:
        DistributedError: No process group runs (a single or simulated process).
        ArgumentError: ``dist`` is not a :class:`DistState`.

    Example:
        >>> import faccel
        >>> faccel.device_mesh(faccel.detect({}))
        Traceback (most recent call last):
        ...
        faccel.errors.DistributedError: device_mesh() on rank 0 of 1 needs a running process group; ...
    """
    if dist.launcher == "simulated":
        msg = "device_mesh() needs real peer processes; a simulated DistState has none"
        raise DistributedError(msg)
    require_group(dist, "device_mesh")
    layout = dist.parallel

    def make() -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(dist.device.type, layout.shape, mesh_dim_names=DIMENSIONS)

    return _cached(dist, ("mesh", layout.shape, dist.device.type), make)


def data_mesh(dist: DistState) -> Any:
    """The data-parallel part of the mesh that ``fully_shard`` shards over.

    ``["shard"]`` (1-D, flat FSDP2) without replicas; ``["replicate", "shard"]``
    (2-D, HSDP: all-gather within a replica, all-reduce across replicas) with them.
    Context-parallel ranks hold the same parameters and their gradients sum, so
    with ``context > 1`` the shards run over shard x context flattened into one
    dimension (``"shard_context"``, torchtitan's ``dp_shard_cp``). Expert ranks deal batches too:
    the parameters outside the split experts shard over shard x expert (``"shard_expert"``),
    as torchtitan's ``dp_shard`` covers the ranks it lends to ``ep``.
    """
    mesh = device_mesh(dist)
    layout = dist.parallel
    inner = ("shard", *(name for name in ("expert", "context") if layout.size(name) > 1))
    shard_name = "_".join(inner)
    if len(inner) > 1:
        flatten_mesh(mesh[inner], shard_name)  # registered on the root mesh, sliced below
    return mesh["replicate", shard_name] if layout.replicate > 1 else mesh[shard_name]


def dimension_group(dist: DistState, dimension: str) -> Any:
    """The process group of this rank's peers along one named dimension (``"pipeline"``, ``"tensor"`` ...).

    From the mesh (a collective the first time: every rank must ask).
    """
    layout = dist.parallel
    layout.size(dimension)  # an unknown name is refused by name
    return device_mesh(dist).get_group(dimension)


def data_group(dist: DistState) -> Any:
    """The process group of this rank's data-parallel peers; None when that is every rank.

    The ranks of one tensor-parallel group hold the same batch, so metrics
    are combined over the data-parallel group alone. Made once per layout,
    the first time any rank asks (a collective: every rank must ask).
    """
    layout = dist.parallel
    if layout.data_size == layout.world_size:
        return None
    require_group(dist, "data_group")

    def make() -> Any:
        groups = [list(g) for g in layout.groups("data")]
        mine, _ = tdist.new_subgroups_by_enumeration(groups, timeout=dist.timeout)
        return mine

    return _cached(dist, ("data", layout.shape, dist.device.type), make)
