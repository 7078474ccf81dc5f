"""Workers for tests/test_torch_compat.py: each private torch API of faccel/_torch_compat.py on real ranks."""

from __future__ import annotations

from typing import Any


def private_apis() -> dict[str, Any]:
    """Call each process-group use of ``_torch_compat`` on a real gloo group; report what it gave."""
    import torch
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel

    from faccel import _torch_compat as compat

    tdist.init_process_group("gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    report: dict[str, Any] = {}
    store = compat.default_store()
    store.set(f"compat/{rank}", "here")
    report["default_store"] = store.get(f"compat/{1 - rank}").decode()  # the peer's key, same store

    ddp = DistributedDataParallel(torch.nn.Linear(3, 2))
    compat.rebuild_ddp_buckets(ddp)
    ddp(torch.ones(1, 3)).sum().backward()  # still trains after the rebuild
    report["rebuild_ddp_buckets"] = ddp.module.weight.grad.tolist()

    mesh = init_device_mesh("cpu", (world,))
    sharded = distribute_tensor(torch.arange(10.0).reshape(5, 2), mesh, [Shard(0)])  # rows 3 + 2
    report["is_dtensor"] = [compat.is_dtensor(sharded), compat.is_dtensor(sharded.to_local())]
    report["local_rows"] = list(compat.local_rows(sharded))
    local, spec = compat.dtensor_local(sharded)  # this rank's rows, and a DTensor of the same placement
    twice = compat.like_dtensor(local * 2, spec)
    report["dtensor_local"] = [
        torch.equal(local, sharded.to_local()),
        compat.is_dtensor(twice) and twice.placements == sharded.placements,
        torch.equal(twice.full_tensor(), sharded.full_tensor() * 2),
    ]

    # a 2-D mesh's two dimensions flattened into one named dimension, sliced from the root by name
    grid = init_device_mesh("cpu", (world, 1), mesh_dim_names=("shard", "context"))
    flat = compat.flatten_mesh(grid["shard", "context"], "shard_context")
    report["flatten_mesh"] = [flat.mesh.tolist(), grid["shard_context"].mesh.tolist()]

    from datetime import timedelta

    compat.set_group_timeout(tdist.group.WORLD, timedelta(seconds=20))
    tdist.barrier()  # the group still works under its new timeout
    report["set_group_timeout"] = True
    return report
