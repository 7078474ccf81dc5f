"""Activation checkpointing in one process: bitwise gradients with dropout, the model's own state_dict
keys, fewer saved activations, and the refusals. The 2-rank cases (FSDP2, DDP) are in
tests/distributed/test_meta_build.py; torch.compile's in tests/test_compile.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from torch import nn

import faccel
from faccel._loop._activation_checkpoint import is_checkpointed
from faccel.errors import ArgumentError, ArgumentValueError, PrepareError
from tests.distributed.meta_workers import Block, TinyGPT
from tests.strategies import checkpointed_stacks

TOKENS = torch.arange(48).reshape(4, 12) % 11


def _grads(selector: Any, seed: int = 0, **options: Any) -> tuple[dict[str, torch.Tensor], nn.Module]:
    dist = faccel.detect({})
    torch.manual_seed(seed)
    model = faccel.prepare(dist, TinyGPT(width=16, depth=3), activation_checkpointing=selector, **options)
    torch.manual_seed(seed + 1)  # the dropout masks
    faccel.backward(dist, model(TOKENS).square().mean())
    return {name: p.grad for name, p in model.named_parameters()}, model


@pytest.mark.parametrize(
    "selector",
    [Block, (Block, nn.LayerNorm), lambda module: isinstance(module, Block)],
    ids=["class", "tuple", "predicate"],
)
def test_gradients_are_bitwise_those_without_it_dropout_included(selector: Any) -> None:
    plain, _ = _grads(None)
    checkpointed, model = _grads(selector)
    assert all(torch.equal(plain[name], checkpointed[name]) for name in plain)
    # the outermost matches only: the LayerNorm inside a block is recomputed with its block
    expected = ["blocks.0", "blocks.1", "blocks.2"] + (["norm"] if isinstance(selector, tuple) else [])
    assert [name for name, m in model.named_modules() if is_checkpointed(m)] == expected
    assert type(model.blocks[0]) is Block  # the class, the tree and the parameters are the user's


def test_the_masks_matter_so_equal_gradients_mean_equal_masks() -> None:
    """Other dropout masks (another seed) give other gradients: the equality above can fail, and does
    with ``preserve_rng_state=False`` (the recomputed forward then draws new masks)."""
    plain, _ = _grads(None)
    reseeded, _ = _grads(None, seed=7)
    assert not all(torch.equal(plain[n], reseeded[n]) for n in plain)


def test_state_dict_and_save_model_names_are_unchanged(tmp_path: Path) -> None:
    from safetensors import safe_open

    dist = faccel.detect({})
    names = {}
    for case, selector in (("plain", None), ("ac", Block)):
        torch.manual_seed(0)
        model = faccel.prepare(dist, TinyGPT(), activation_checkpointing=selector)
        names[case] = (list(model.state_dict()), [n for n, _ in model.named_parameters()])
        faccel.save_model(dist, model, tmp_path / case)
        with safe_open(str(tmp_path / case / "model.safetensors"), framework="pt") as f:
            names[case] += (sorted(f.keys()),)
    assert names["plain"] == names["ac"]


def test_a_checkpoint_of_a_checkpointed_model_restores_into_a_plain_one(tmp_path: Path) -> None:
    dist = faccel.detect({})
    torch.manual_seed(0)
    model = faccel.prepare(dist, TinyGPT(), activation_checkpointing=Block)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    faccel.backward(dist, model(TOKENS).square().mean())
    optimizer.step()
    faccel.checkpoint(dist, faccel.TrainState(model=model, optimizer=optimizer, step=1), tmp_path)
    torch.manual_seed(3)
    plain = TinyGPT()
    target = faccel.TrainState(model=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1))
    restored = faccel.restore(dist, target, tmp_path)
    assert restored.step == 1
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True)
    )


def _saved_bytes(model: nn.Module) -> int:
    """Bytes autograd keeps for one forward's backward (of a checkpointed region: its inputs)."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(TOKENS).square().mean()
    return total


def test_it_keeps_fewer_activations() -> None:
    dist = faccel.detect({})
    torch.manual_seed(0)
    plain = _saved_bytes(faccel.prepare(dist, TinyGPT(width=32, depth=4)))
    torch.manual_seed(0)
    checkpointed = _saved_bytes(
        faccel.prepare(dist, TinyGPT(width=32, depth=4), activation_checkpointing=Block)
    )
    assert checkpointed < plain / 2, (checkpointed, plain)


def test_preparing_again_does_not_checkpoint_twice() -> None:
    dist = faccel.detect({})
    model = TinyGPT()
    faccel.prepare(dist, model, activation_checkpointing=Block)
    forward = model.blocks[0].forward
    faccel.prepare(dist, model, activation_checkpointing=Block)
    assert model.blocks[0].forward == forward
    plain, _ = _grads(None)
    torch.manual_seed(0)
    again = TinyGPT(width=16, depth=3)
    for _ in range(2):
        faccel.prepare(dist, again, activation_checkpointing=Block)
    torch.manual_seed(1)
    faccel.backward(dist, again(TOKENS).square().mean())
    assert all(torch.equal(plain[n], p.grad) for n, p in again.named_parameters())


def test_a_model_prepared_before_gets_it_when_prepared_again_with_it() -> None:
    low = faccel.detect({}, precision="bf16")  # an autocast wrapper: prepare again returns that one
    model = TinyGPT()
    wrapped = faccel.prepare(low, model)
    assert faccel.prepare(low, model, activation_checkpointing=Block) is wrapped
    assert faccel.prepare(low, wrapped, activation_checkpointing=nn.LayerNorm) is wrapped
    assert [name for name, m in model.named_modules() if is_checkpointed(m)] == [
        "blocks.0",
        "blocks.1",
        "norm",
    ]


def test_refusals_name_the_argument() -> None:
    dist = faccel.detect({})
    with pytest.raises(ArgumentError, match="activation_checkpointing"):
        faccel.prepare(dist, TinyGPT(), activation_checkpointing="Block")
    for bad in ((Block, "x"), (), int):
        with pytest.raises(ArgumentValueError, match="activation_checkpointing must be a module class"):
            faccel.prepare(dist, TinyGPT(), activation_checkpointing=bad)
    with pytest.raises(
        PrepareError, match=r"activation_checkpointing=Conv1d matches no submodule of the TinyGPT"
    ):
        faccel.prepare(dist, TinyGPT(), activation_checkpointing=nn.Conv1d)

    def never(module: nn.Module) -> bool:
        return False

    with pytest.raises(PrepareError, match="activation_checkpointing=never matches no submodule"):
        faccel.prepare(dist, TinyGPT(), activation_checkpointing=never)
    hooked = TinyGPT()
    hooked.blocks[1].forward = lambda x: x  # what a hook library does
    with pytest.raises(PrepareError, match=r"matched blocks\.1 \(Block\), whose forward was replaced"):
        faccel.prepare(dist, hooked, activation_checkpointing=Block)
    assert not is_checkpointed(hooked.blocks[0])  # checked before anything is changed


def test_fsdp_options_are_refused_outside_fsdp_and_checked_for_their_values() -> None:
    ddp = faccel.detect({})
    with pytest.raises(PrepareError, match="offload='cpu', an FSDP2 option, but strategy='ddp'"):
        faccel.prepare(ddp, TinyGPT(), offload="cpu")
    with pytest.raises(PrepareError, match="reshard_after_forward=False, an FSDP2 option"):
        faccel.prepare(ddp, TinyGPT(), reshard_after_forward=False)
    with pytest.raises(ArgumentValueError, match=r"offload must be None .* or 'cpu'"):
        faccel.prepare(faccel.detect({}, strategy="fsdp"), TinyGPT(), offload="gpu")
    deepspeed = faccel.detect({}, strategy="deepspeed", deepspeed={"zero_optimization": {"stage": 2}})
    with pytest.raises(PrepareError, match="offload='cpu', an FSDP2 option, but strategy='deepspeed'"):
        faccel.prepare(deepspeed, TinyGPT(), offload="cpu")
    with pytest.raises(PrepareError, match="faccel's activation_checkpointing is not applied there"):
        faccel.prepare(deepspeed, TinyGPT(), activation_checkpointing=Block)
    # strategy='fsdp' in one process shards nothing: the options are accepted, so one script runs anywhere
    fsdp = faccel.detect({}, strategy="fsdp")
    model = faccel.prepare(fsdp, TinyGPT(), offload="cpu", reshard_after_forward=False)
    assert faccel.unwrap_model(model).embed.weight.device.type == "cpu"


class _Stack(nn.Module):
    def __init__(self, depth: int, width: int, p: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(p)) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


@settings(max_examples=15, deadline=None)
@given(spec=checkpointed_stacks())
def test_any_choice_of_blocks_gives_the_gradients_of_none(spec: dict) -> None:
    dist = faccel.detect({})
    grads = []
    for chosen in (None, spec["chosen"]):
        torch.manual_seed(spec["seed"])
        model = _Stack(spec["depth"], spec["width"], spec["p"])
        picked = {id(model.layers[i]) for i in chosen or ()}
        selector = (lambda m, picked=picked: id(m) in picked) if chosen else None
        model = faccel.prepare(dist, model, activation_checkpointing=selector)
        torch.manual_seed(spec["seed"] + 1)
        x = torch.randn(3, spec["width"], requires_grad=True)
        faccel.backward(dist, model(x).square().sum())
        grads.append([x.grad, *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
