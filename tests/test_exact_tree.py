"""Exact mode's tree (faccel/_loop/_exact/_tree_reduce.py): the ranks' sum is bitwise the one-process sum.

Laws, for any atom count A (a power of two) and any data-parallel size W dividing it, with real
float tensors whose magnitudes span many orders (so that a different order of additions shows):

* each rank sums its atoms ``r, r + W, ...`` with the binary counter, in bit-reversed order;
* the ranks combine those sums along :func:`plan` (simulated in one process, the same plans the
  point-to-point exchange runs);
* every rank then holds exactly the bits of ``tree_sum`` over all atoms in one process.

``scripts/prove_exact.py --tree N`` runs the same law with many more examples.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings

from faccel._loop._exact._tree_reduce import (
    TreeStack,
    bit_reversed,
    plan,
    simulate_exchange,
    tree_sum,
)
from tests.strategies import atom_layouts

DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def leaves(layout: dict) -> list[list[torch.Tensor]]:
    """Each atom's buffers (one per dtype): values from 1e-6 to 1e6 in size, both signs."""
    generator = torch.Generator().manual_seed(layout["seed"])
    out = []
    for _ in range(layout["atoms"]):
        buffers = []
        for i, numel in enumerate(layout["numels"]):
            scale = torch.pow(10.0, torch.randint(-6, 7, (numel,), generator=generator).double())
            values = torch.randn(numel, generator=generator, dtype=torch.float64) * scale
            buffers.append(values.to(DTYPES[i % len(DTYPES)]))
        out.append(buffers)
    return out


def local_sum(atoms: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """What one rank computes: its atoms pushed in bit-reversed order through the binary counter."""
    stack = TreeStack()
    for i in bit_reversed(len(atoms)):
        stack.push([b.clone() for b in atoms[i]])
    return stack.result()


def reference(atoms: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The fixed tree over every atom, in one process (the recursive definition)."""
    return [tree_sum([a[i] for a in atoms]) for i in range(len(atoms[0]))]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def tree_law(layout: dict) -> None:
    """Any allowed world size gives, on every rank, the bits of the one-process tree."""
    atoms = leaves(layout)
    world = layout["world"]
    expected = reference(atoms)
    nodes = [local_sum(atoms[rank::world]) for rank in range(world)]
    for held in simulate_exchange(nodes):
        assert all(same_bits(h, e) for h, e in zip(held, expected, strict=True))


@settings(max_examples=60, deadline=None)
@given(atom_layouts())
def test_every_world_size_gives_the_one_process_tree_on_every_rank(layout: dict) -> None:
    tree_law(layout)


@settings(max_examples=30, deadline=None)
@given(atom_layouts())
def test_the_binary_counter_in_bit_reversed_order_is_the_recursive_tree(layout: dict) -> None:
    atoms = leaves(layout)
    assert all(same_bits(a, b) for a, b in zip(local_sum(atoms), reference(atoms), strict=True))


def test_the_order_matters_so_the_law_is_not_trivial() -> None:
    """A left fold of the same atoms (what an accumulation in rank order does) gives other bits."""
    values = [torch.tensor([v], dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0, 3.0, 1e-3, -3.0, 7.0)]
    fold = values[0].clone()
    for v in values[1:]:
        fold += v
    assert not same_bits(fold, tree_sum(values))


def test_each_round_pairs_ranks_with_the_partner_the_tree_names() -> None:
    """Partners at world 8: 4 apart, then 2, then 1; halves sent while halving, sums sent back."""
    rounds = plan(5, 8, 16)
    assert [r.partner for r in rounds] == [1, 7, 4, 4, 7, 1]
    assert [r.add for r in rounds] == [True, True, True, False, False, False]
    # Rank 5 = 0b101 keeps the upper half, then the lower quarter of it, then its upper eighth.
    assert [r.take for r in rounds[:3]] == [(8, 16), (8, 12), (10, 12)]
    assert [r.take for r in plan(5, 8, 3)] == [(0, 3)] * 3  # smaller than the world: sent whole


def test_bit_reversal_and_the_reference() -> None:
    assert bit_reversed(1) == [0]
    assert bit_reversed(16)[:5] == [0, 8, 4, 12, 2]
    assert tree_sum(list("abcdefgh")) == "aecgbfdh"
