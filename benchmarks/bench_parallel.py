"""Four-process layouts over gloo: a training step under faccel vs the same step written with PyTorch's APIs.

Four processes are spawned. For each layout (``shard=2,tensor=2``: FSDP2 + tensor
parallelism; ``replicate=2,shard=2``: HSDP; ``tensor=4``: tensor parallelism alone) each
rank trains three copies of examples/parallel_transformer.py's model (2 blocks, width 16,
sequences of 4, 8 sequences a step in all): one set up by hand (``init_device_mesh``,
``parallelize_module`` with the same plan, ``fully_shard`` on each block and the root),
one by ``faccel.detect(layout=...)`` and ``faccel.prepare(..., tp_plan=...)``. Blocks of
steps alternate between them (order rotating), rank 0 times them with the wall clock. A
second hand-written model is timed too: its ratio to the first is the noise floor.
The model is tiny so that the step is all framework and collectives: the ratio shows what
faccel adds, not what the matmuls cost.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import FACCEL, Row, interleave, per_call, rank_env, rows, run_ranks

RAW = "PyTorch by hand"
# The same hand-written step again, a second model: its ratio to RAW is the noise floor
# (4 processes on 2 shared cores), against which faccel's ratio is read.
AGAIN = "PyTorch by hand, again"
LAYOUTS = ("shard=2,tensor=2", "replicate=2,shard=2", "tensor=4")
WORLD = 4
_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "parallel_transformer.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("example_parallel_transformer", _EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _by_hand(ex: Any, layout: Any) -> Any:
    """The model set up with PyTorch's own APIs, as a torchtitan-style script does."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = ex.TinyTransformer()
    names = ("replicate", "shard", "tensor")
    mesh = init_device_mesh("cpu", tuple(layout.size(name) for name in names), mesh_dim_names=names)
    if layout.tensor > 1:
        parallelize_module(model, mesh["tensor"], ex.PLAN)
    if layout.data_size > 1:
        dp = mesh["replicate", "shard"] if layout.replicate > 1 else mesh["shard"]
        for block in model.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


def _block(model: Any, optimizer: Any, backward: Any, pool: list[Any], steps: int) -> Any:
    """A callable that times ``steps`` training steps on ``pool``'s batches, every rank starting together."""
    import torch
    import torch.distributed as tdist

    data = itertools.cycle(pool)

    def step() -> None:
        inputs, targets = next(data)
        optimizer.zero_grad()
        backward(torch.nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()

    def timed() -> float:
        tdist.barrier()
        return per_call(step, steps, now=time.perf_counter)

    return timed


def _worker(rank: int, port: int, plan: tuple[int, int], out: str) -> None:
    os.environ.update(rank_env(rank, port, world_size=WORLD))
    import torch

    import faccel

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    rounds, steps = plan
    ex = _example()
    results: dict[str, dict[str, list[float]]] = {}
    for text in LAYOUTS:
        dist = faccel.detect(layout=text)
        # every rank of a tensor-parallel group must feed the same batch: seeded by data rank
        generator = torch.Generator().manual_seed(1 + dist.data_rank)
        per_rank = ex.GLOBAL_BATCH // dist.data_world_size
        pool = [
            (
                torch.randn(per_rank, ex.SEQ, ex.DIM, generator=generator),
                torch.randn(per_rank, ex.SEQ, generator=generator),
            )
            for _ in range(4)
        ]
        hand = {}
        for name in (RAW, AGAIN):
            raw_model = _by_hand(ex, dist.parallel)
            raw_optimizer = torch.optim.SGD(raw_model.parameters(), lr=0.01)
            hand[name] = _block(raw_model, raw_optimizer, torch.Tensor.backward, pool, steps)
        torch.manual_seed(0)
        model = ex.TinyTransformer()
        model, optimizer = faccel.prepare(
            dist, model, torch.optim.SGD(model.parameters(), lr=0.01), tp_plan=ex.PLAN
        )
        fac = _block(model, optimizer, functools.partial(faccel.backward, dist), pool, steps)
        results[text] = interleave({**hand, FACCEL: fac}, rounds=rounds)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    faccel.shutdown(dist)


def run(quick: bool) -> list[Row]:
    plan = (4, 8) if quick else (15, 30)
    samples: Any = run_ranks(_worker, plan, what="parallel layouts benchmark", world_size=WORLD)
    out: list[Row] = []
    for text in LAYOUTS:
        out += rows(
            f"tiny transformer, layout {text}, 8 sequences a step, {WORLD} gloo processes "
            f"({plan[1]} steps a block)",
            samples[text],
            baseline=RAW,
            unit="ms/step",
            scale=1e3,
            goals="parallel_step",
            notes={AGAIN: "the noise floor: the same step as the baseline, another model"},
        )
    return out
