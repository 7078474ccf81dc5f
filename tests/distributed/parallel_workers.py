"""Workers for tests/distributed/test_parallel_layouts.py: examples/parallel_transformer.py in one layout,
checkpointed, then restored into the same layout and into another, in the same processes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import attrs

import faccel
from faccel._dist._layout import DIMENSIONS
from faccel._dist._mesh import data_group

_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "parallel_transformer.py"


def example() -> Any:
    """examples/parallel_transformer.py as a module, loaded once per process."""
    name = "example_parallel_transformer"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _placements(model: Any) -> dict[str, str]:
    inner = faccel.unwrap_model(model)
    return {
        name: type(p).__name__ + repr(tuple(getattr(p, "placements", ())))
        for name, p in inner.named_parameters()
    }


def _resume(layout: str, root: str, model_dir: str | None, accumulation_steps: int) -> dict[str, Any]:
    ex = example()
    dist = faccel.detect(layout=layout, accumulation_steps=accumulation_steps)
    state, loader = ex.build(dist)
    state = faccel.restore(dist, state, root)
    resumed_at = (state.step, state.epoch, state.position)
    state, log = ex.train(dist, state, loader, epochs=2)
    if model_dir is not None:
        faccel.save_model(dist, state.model, model_dir)
    return {"at": list(resumed_at), **log, "predictions": ex.predictions(dist, state, loader)}


def layout_run(
    *, layout: str, other: str, root: str, model_dir: str, same_dir: str, accumulation_steps: int = 1
) -> dict[str, Any]:
    """Two epochs in ``layout``, a checkpoint between them; then epoch 2 again from it, in ``layout``
    (bitwise) and in ``other`` (resharded); and a mid-epoch checkpoint refused by ``other``."""
    ex = example()
    dist = faccel.detect(layout=layout, accumulation_steps=accumulation_steps)
    import torch.distributed as tdist

    coordinates = list(dist.parallel.coordinates(dist.rank))
    mesh = faccel.device_mesh(dist)
    group = data_group(dist)
    groups = {
        "data": tdist.get_process_group_ranks(group) if group is not None else list(range(dist.world_size)),
        **{name: tdist.get_process_group_ranks(mesh.get_group(name)) for name in DIMENSIONS},
    }
    state, loader = ex.build(dist)
    state, first = ex.train(dist, state, loader, epochs=1)
    faccel.checkpoint(dist, state, f"{root}/boundary")
    state, second = ex.train(dist, state, loader, epochs=2)
    faccel.save_model(dist, state.model, model_dir)
    result: dict[str, Any] = {
        "rank": tdist.get_rank(),
        "coordinates": coordinates,
        "groups": groups,
        "mesh_kept": faccel.device_mesh(dist) is mesh and mesh.mesh_dim_names == DIMENSIONS,
        "data_rank": dist.data_rank,
        "strategy": dist.strategy,
        "placements": _placements(state.model),
        "loss": first["loss"] + second["loss"],
        "norm": first["norm"] + second["norm"],
        "indices": first["indices"] + second["indices"],
        "samples": first["samples"] + second["samples"],
        "predictions": ex.predictions(dist, state, loader),
    }
    result["same"] = _resume(layout, f"{root}/boundary", same_dir, accumulation_steps)
    result["other"] = _resume(other, f"{root}/boundary", None, 1)

    # A checkpoint inside an epoch counts batches of this layout's data-parallel ranks:
    # another layout with another count must refuse it, not read other samples.
    mid = attrs.evolve(state, epoch=0, position=1)
    faccel.checkpoint(dist, mid, f"{root}/mid")
    other_dist = faccel.detect(layout=other)
    fresh, _ = ex.build(other_dist)
    try:
        faccel.restore(other_dist, fresh, f"{root}/mid")
        result["mid_refused"] = ""
    except faccel.errors.CheckpointError as error:
        result["mid_refused"] = str(error)

    # bf16: autocast under tensor parallelism alone, FSDP2's MixedPrecisionPolicy otherwise
    low = faccel.detect(layout=layout, precision="bf16")
    low_state, loader = ex.build(low)
    result["bf16_loss"] = ex.train(low, low_state, loader, epochs=2)[1]["loss"]
    # prepared again, the model comes back as it is (no second wrapping, no second plan)
    result["prepared_again"] = [
        faccel.prepare(d, faccel.unwrap_model(s.model)) is s.model
        for d, s in ((dist, state), (low, low_state))
    ]
    return result
