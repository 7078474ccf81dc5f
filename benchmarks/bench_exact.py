"""Exact mode's price: a step at 8 atoms vs ordinary DDP at the same global batch, and vs one process.

Two models of ~10M parameters, AdamW, ``atoms=8``, one thread per process:

* a small transformer (10 layers of width 256, dropout 0.1, causal attention over 32 tokens;
  global batch 64 sequences, atoms of 8): the kind of model the exact-mode tests and example
  train, at ~10M parameters;
* the stress case, an MLP of ~9.4M parameters (256-2048-2048-2048-256, global batch 512, atoms of
  64): its 64-row products re-read 16 MB weight matrices once per atom, so most of its price is
  the micro-batching itself (docs/exact.md, "What it costs").

On 2 and 4 gloo processes each rank trains copies side by side on the same batches of a prepared
loader: ordinary faccel DDP (one forward and backward of its batch, DDP's bucketed all-reduce),
and exact mode (``micro_batches(..., atoms=8, model=model)``: 8/W atoms each, the fixed tree, the
point-to-point exchange); for the MLP also ordinary accumulation over the same atoms (each rank's
8/W slices, forward and backward under DDP's ``no_sync`` but the last: the floor that computing
the atoms apart sets, which exact mode's own work adds to). Blocks of steps alternate, the order
rotating; rank 0 times them. In one process the same exact step is compared with a plain step of
the whole batch.

Bytes sent per rank per step are computed from the sizes, not captured: exact mode's from the
exchange's own plan (recursive halving, then the halves sent back: 2 (W-1)/W of the gradient
bytes); DDP's as a ring all-reduce sends them, the same 2 (W-1)/W.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import FACCEL, Row, interleave, rank_env, rows, run_ranks

DDP = "ordinary DDP"
PLAIN = "one process, plain"
ACCUMULATION = "accumulating the same atoms"
ATOMS = 8

MLP = "mlp"
TRANSFORMER = "transformer"
SIZES = (256, 2048, 2048, 2048, 256)  # the MLP
VOCAB, WIDTH, LAYERS, LENGTH = 4096, 256, 10, 32  # the transformer
GLOBAL_BATCH = {MLP: 512, TRANSFORMER: 64}


def _model(kind: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == MLP:
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(SIZES):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1])

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.1, batch_first=True)
            self.body = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.head = nn.Linear(WIDTH, VOCAB)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(LENGTH))

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(self.embed(tokens), mask=self.mask, is_causal=True))  # type: ignore[no-any-return]

    return TinyLM()


def _parts(kind: str) -> Any:
    import torch

    model = _model(kind)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _data(kind: str, samples: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(0)
    if kind == MLP:
        inputs = torch.randn(samples, SIZES[0], generator=generator)
        return TensorDataset(inputs, torch.randn(samples, SIZES[-1], generator=generator))
    tokens = torch.randint(0, VOCAB, (samples, LENGTH + 1), generator=generator)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _loss(kind: str, output: Any, target: Any) -> Any:
    import torch.nn.functional as F

    if kind == MLP:
        return F.mse_loss(output, target)
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def _worker(rank: int, port: int, plan: tuple[int, int, int, str], out: str) -> None:
    world, rounds, steps, kind = plan
    os.environ.update(rank_env(rank, port, world))
    import torch
    import torch.distributed as tdist
    from torch.utils.data import DataLoader

    import faccel

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist = faccel.detect()
    global_batch = GLOBAL_BATCH[kind]
    raw = DataLoader(_data(kind, global_batch * steps), batch_size=global_batch // world, drop_last=True)

    ordinary_model, ordinary_optimizer, loader = faccel.prepare(dist, *_parts(kind), raw)
    exact_model, exact_optimizer = faccel.prepare(dist, *_parts(kind))
    # The MLP's third arm (the transformer's exact step already costs DDP's): built for it only.
    accumulating_model, accumulating_optimizer = (
        faccel.prepare(dist, *_parts(kind)) if kind == MLP else (None, None)
    )
    epochs = itertools.count()

    def wait() -> None:
        if dist.distributed:
            tdist.barrier()  # every rank starts the block together

    def ordinary() -> float:
        view = loader.at(epoch=next(epochs))
        wait()
        start = time.perf_counter()
        for inputs, targets in view:
            ordinary_optimizer.zero_grad()
            faccel.backward(dist, _loss(kind, ordinary_model(inputs), targets))
            ordinary_optimizer.step()
        return (time.perf_counter() - start) / steps

    def exact() -> float:
        view = loader.at(epoch=next(epochs))
        wait()
        start = time.perf_counter()
        for micro, (inputs, targets) in faccel.micro_batches(dist, view, atoms=ATOMS, model=exact_model):
            with faccel.accumulate(dist, exact_model, micro):
                faccel.backward(dist, _loss(kind, exact_model(inputs), targets), micro=micro)
            if micro.sync:
                exact_optimizer.step()
        return (time.perf_counter() - start) / steps

    def accumulating() -> float:
        """Ordinary accumulation over this rank's atoms (the same slices), DDP syncing the last one."""
        view = loader.at(epoch=next(epochs))
        local = ATOMS // world
        wait()
        start = time.perf_counter()
        for inputs, targets in view:
            accumulating_optimizer.zero_grad()
            for i in range(local):
                piece = inputs[i::local].contiguous(), targets[i::local].contiguous()
                last = i == local - 1
                # The forward too inside no_sync: DDP decides at the forward whether to all-reduce.
                with contextlib.nullcontext() if last or world == 1 else accumulating_model.no_sync():
                    (_loss(kind, accumulating_model(piece[0]), piece[1]) / local).backward()
            accumulating_optimizer.step()
        return (time.perf_counter() - start) / steps

    subjects = {DDP if world > 1 else PLAIN: ordinary, FACCEL: exact}
    if kind == MLP:
        subjects[ACCUMULATION] = accumulating
    figures = interleave(subjects, rounds=rounds)
    if rank == 0:
        Path(out).write_text(json.dumps(figures))
    faccel.shutdown(dist)


def _bytes(kind: str, world: int) -> tuple[float, float]:
    """MB each rank sends per step: exact mode's exchange (from its plan), and a ring all-reduce's."""
    from faccel._loop._exact._tree_reduce import plan

    numel = sum(p.numel() for p in _model(kind).parameters())
    exact = sum(r.give[1] - r.give[0] for r in plan(0, world, numel)) * 4 + len(plan(0, world, 1)) * 8
    ring = 2 * (world - 1) / world * numel * 4
    return exact / 1e6, ring / 1e6


def _over_accumulation(figures: dict[str, list[float]]) -> str:
    """Exact mode's step over ordinary accumulation's of the same atoms: the median of the paired rounds."""
    pairs = [a / b for a, b in zip(figures[FACCEL], figures[ACCUMULATION], strict=True)]
    return f"; {statistics.median(pairs):.3f}x the accumulation's step"


def run(quick: bool) -> list[Row]:
    rounds = 3 if quick else 5
    out: list[Row] = []
    for kind, steps in ((TRANSFORMER, 2), (MLP, 3)):
        what = (
            f"~10M-param transformer ({LAYERS} layers, width {WIDTH}, {LENGTH} tokens), "
            f"global batch {GLOBAL_BATCH[kind]}"
            if kind == TRANSFORMER
            else f"~9.4M-param MLP, global batch {GLOBAL_BATCH[kind]}"
        )
        for world in (1, 2, 4):
            # --quick: one transformer step a block (~2 s of one core each), two MLP steps.
            plan = (world, rounds, (1 if kind == TRANSFORMER else 2) if quick else steps, kind)
            figures: dict[str, list[float]] = run_ranks(  # type: ignore[assignment]
                _worker, plan, what="exact-mode benchmark", world_size=world
            )
            atom = GLOBAL_BATCH[kind] // ATOMS
            if world > 1:
                sent, ring = _bytes(kind, world)
                notes = {FACCEL: f"sends {sent:.1f} MB/step per rank"}
                notes[DDP] = f"ring all-reduce {ring:.1f} MB/step"
                case = f"{what}, {world} gloo processes, atoms={ATOMS}"
            else:
                notes = {FACCEL: f"{ATOMS} atoms of {atom} in one process"}
                case = f"{what}, one process, atoms={ATOMS}"
            if ACCUMULATION in figures:
                notes[FACCEL] += _over_accumulation(figures)
                how = "per rank, DDP's no_sync but the last" if world > 1 else "in one process"
                notes[ACCUMULATION] = f"{ATOMS // world} micro-batches of {atom} {how}"
            out += rows(
                case,
                figures,
                baseline=DDP if world > 1 else PLAIN,
                unit="ms/step",
                scale=1e3,
                goals="exact_step" if world > 1 else None,
                notes=notes,
            )
    return out
