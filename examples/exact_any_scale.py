"""The same weights, bit for bit, at every data-parallel size and across resumes that change it.

python examples/exact_any_scale.py            # sizes 1, 2 and 4, and a run resized 2 -> 4 -> 1
python examples/exact_any_scale.py --sizes 1 2 4 8

A small transformer language model with dropout, trained with AdamW, a
schedule, clipping, accumulation of 2 batches and the loss by token count,
for 20 optimizer steps (2 epochs of a shuffled dataset), in exact mode:
``faccel.micro_batches(dist, loader, atoms=8, model=model, items=...)``. The
script trains it straight through on 1, 2 and 4 gloo processes, and once more
on 2 processes stopped at step 7 (mid-epoch, checkpointed), resumed on 4,
stopped at step 14, and finished in one process. Every run ends with the same
SHA-256 of the weights and the AdamW state, and logs the same losses, bit for
bit. See docs/exact.md.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import faccel

VOCAB, LENGTH, WIDTH = 32, 12, 32
SAMPLES = 320
GLOBAL_BATCH = 16  # samples per loader batch, over all ranks together
ACCUMULATION = 2  # loader batches per optimizer step: 32 samples a step, 10 steps an epoch
ATOMS = 8  # each global batch in 8 atoms of 2 samples, at every size
STEPS = 20


class TinyLM(nn.Module):
    """Two transformer layers with dropout over a small vocabulary, next-token prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.place = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.02)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 64, dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(LENGTH))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.place
        return self.head(self.body(hidden, mask=self.mask, is_causal=True))  # type: ignore[no-any-return]


def dataset() -> TensorDataset:
    """Token sequences of random lengths; labels are the next tokens, -100 past each length."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (SAMPLES, LENGTH + 1), generator=generator)
    lengths = torch.randint(4, LENGTH + 1, (SAMPLES,), generator=generator)
    labels = tokens[:, 1:].clone()
    labels[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = -100
    return TensorDataset(tokens[:, :-1], labels)


def count_tokens(batch: Any) -> int:
    """The items of a batch: its labelled tokens."""
    return int((batch[1] != -100).sum())


def build(dist: faccel.DistState) -> tuple[faccel.TrainState, faccel.PreparedLoader]:
    """The run's objects at step 0, identical at every size."""
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (2 * STEPS))
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH // dist.data_world_size, shuffle=True)
    model, optimizer, scheduler, loader = faccel.prepare(dist, model, optimizer, scheduler, loader)
    state = faccel.TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
    return state, loader


def digest(state: faccel.TrainState) -> str:
    """SHA-256 of the weights and the optimizer's state, bit for bit."""
    h = hashlib.sha256()
    tensors = list(faccel.unwrap_model(state.model).state_dict().items())
    assert state.optimizer is not None
    for index, slots in sorted(state.optimizer.state_dict()["state"].items()):
        tensors += [(f"{index}.{name}", value) for name, value in sorted(slots.items())]
    for name, value in tensors:
        h.update(name.encode())
        h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(root: str | None = None, stop_at: int = STEPS, resume: bool = False) -> dict[str, Any]:
    """Train (from ``root``'s checkpoint if ``resume``) to step ``stop_at``; checkpoint there if ``root``."""
    torch.set_num_threads(1)  # the same thread count in every process, at every size
    dist = faccel.detect(accumulation_steps=ACCUMULATION)
    state, loader = build(dist)
    if resume and root is not None:
        state = faccel.restore(dist, state, root)
    model, optimizer = state.model, state.optimizer
    assert optimizer is not None
    losses: list[float] = []
    while state.step < stop_at:
        view = loader.resume(state)
        batches = faccel.micro_batches(dist, view, atoms=ATOMS, model=model, items=count_tokens)
        for micro, (tokens, labels) in batches:
            with faccel.accumulate(dist, model, micro):
                logits = model(tokens)
                loss = nn.functional.cross_entropy(
                    logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
                )
                faccel.backward(dist, loss, micro=micro, items=count_tokens((tokens, labels)))
            if micro.sync:
                faccel.clip_grad_norm(dist, model, 1.0)
                faccel.optimizer_step(dist, optimizer, scheduler=state.scheduler)
                optimizer.zero_grad()
                assert micro.atom is not None and micro.atom.group.loss is not None
                losses.append(micro.atom.group.loss.item())  # the same bits at every size
                state = attrs.evolve(state, step=state.step + 1, position=micro.index + 1)
                if state.step == stop_at:
                    break
        else:
            state = attrs.evolve(state, epoch=state.epoch + 1, position=0)
    if root is not None and stop_at < STEPS:
        faccel.checkpoint(dist, state, root)
    return {"digest": digest(state), "losses": losses, "step": state.step, "world": dist.world_size}


def on(size: int, **kwargs: Any) -> dict[str, Any]:
    """``train(**kwargs)`` on ``size`` gloo processes; rank 0's result."""
    return faccel.launch(train, nprocs=size, kwargs=kwargs)  # type: ignore[no-any-return]


def main(sizes: list[int]) -> bool:
    torch.set_num_threads(1)
    straight = {size: on(size) for size in sizes}
    with tempfile.TemporaryDirectory() as folder:
        first = on(2, root=f"{folder}/a", stop_at=7)
        second = on(4, root=f"{folder}/a", stop_at=14, resume=True)
        third = on(1, root=f"{folder}/a", resume=True)
    reference = straight[sizes[0]]
    for size, result in straight.items():
        print(f"{size} process(es), 20 steps: {result['digest'][:16]}  loss[-1] {result['losses'][-1]!r}")
    resized_losses = first["losses"] + second["losses"] + third["losses"]
    print(f"2 -> 4 -> 1 processes (stops at steps 7, 14): {third['digest'][:16]}")
    same = all(
        r["digest"] == reference["digest"] and r["losses"] == reference["losses"] for r in straight.values()
    )
    same_resized = third["digest"] == reference["digest"] and resized_losses == reference["losses"]
    print(f"weights, AdamW state and losses equal at every size (bitwise): {same}")
    print(f"and equal after resizing 2 -> 4 -> 1 (bitwise): {same_resized}")
    return same and same_resized


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    sys.exit(0 if main(parser.parse_args().sizes) else 1)
