"""Exact mode in one process (faccel/_loop/_exact/_mode.py): simulated ranks, the checks, mode off unchanged.

A simulated rank (``DistState.simulated``) computes its node of the tree: its atoms' sum, left in
``.grad``. Combined along the exchange's plans (``simulate_exchange``), the nodes of every allowed
size give the gradient and the loss of one process bit for bit: the whole pipeline (the loader's
dealing, the atom split, the seeds, the weights of each piece, the binary counter) checked
without processes. ``tests/distributed/test_exact.py`` runs it over gloo.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import faccel
from faccel._loop._exact._mode import _agree, atom_seed
from faccel._loop._exact._tree_reduce import simulate_exchange
from faccel.errors import ArgumentError, ArgumentValueError, UsageError

SAMPLES = 64


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 6, generator=generator) * torch.logspace(-3, 3, 6)
    return TensorDataset(x, torch.randn(SAMPLES, 1, generator=generator))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1))


def node(rank: int, world: int, atoms: int, k: int, global_batch: int, items: bool) -> list[torch.Tensor]:
    """Rank ``rank`` of ``world`` (simulated) runs the first optimizer step: its node's grads and loss."""
    dist = faccel.DistState.simulated(rank=rank, world_size=world, accumulation_steps=k)
    net = model()
    loader = faccel.prepare(dist, DataLoader(data(), batch_size=global_batch // world, shuffle=True))
    # A simulated rank has no peers to sum the counts with: count as if every rank read this many.
    count = (lambda batch: int(batch[0].shape[0]) * 3 * world) if items else None
    for micro, (x, y) in faccel.micro_batches(dist, loader, atoms=atoms, model=net, items=count):
        with faccel.accumulate(dist, net, micro):
            loss = nn.functional.mse_loss(net(x), y, reduction="sum" if items else "mean")
            faccel.backward(dist, loss, micro=micro, items=x.shape[0] * 3 if items else None)
        if micro.sync:
            assert micro.atom is not None and micro.atom.group.loss is not None
            grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
            return [grads, micro.atom.group.loss.reshape(1)]
    raise AssertionError("no step")


@pytest.mark.parametrize(
    ("atoms", "k", "items"), [(1, 1, False), (2, 2, False), (4, 1, True), (8, 2, True), (8, 1, False)]
)
def test_simulated_ranks_combine_to_the_one_process_step_bit_for_bit(atoms: int, k: int, items: bool) -> None:
    one = node(0, 1, atoms, k, 16, items)
    world = 2
    while world <= atoms:
        nodes = [node(rank, world, atoms, k, 16, items) for rank in range(world)]
        for held in simulate_exchange(nodes):
            for a, b in zip(held, one, strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (atoms, world, k)
        world *= 2


def test_without_the_tree_the_sizes_disagree() -> None:
    """The control: plain accumulation at sizes 1 and 2 gives other bits (the mode is needed)."""

    def plain(world: int) -> torch.Tensor:
        sums = []
        for rank in range(world):
            dist = faccel.DistState.simulated(rank=rank, world_size=world, accumulation_steps=8 // world)
            net = model()
            net.eval()  # no dropout: only the order of additions differs
            loader = faccel.prepare(dist, DataLoader(data(), batch_size=2))
            for micro, (x, y) in faccel.micro_batches(dist, loader):
                faccel.backward(dist, nn.functional.mse_loss(net(x), y), micro=micro)
                if micro.sync:
                    break
            sums.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
        return sum(sums[1:], sums[0]) / world

    assert not torch.equal(plain(1), plain(2))


def test_each_piece_runs_under_its_atom_seed_and_the_callers_generator_is_restored() -> None:
    dist = faccel.DistState.simulated(rank=1, world_size=2)
    net = model()
    loader = faccel.prepare(dist, DataLoader(data(), batch_size=4, drop_last=True))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    seen = []
    for micro, (x, _) in faccel.micro_batches(dist, loader, atoms=4, model=net):
        assert micro.atom is not None
        # Rank 1 of 2 holds atoms 1 and 3 (positions p % 4), in the tree's order.
        seen.append((micro.atom.index, micro.atom.seed, torch.rand(1).item()))
        with faccel.accumulate(dist, net, micro):
            faccel.backward(dist, net(x).sum(), micro=micro)
        assert torch.equal(torch.get_rng_state(), before)
        if len(seen) == 4:
            break
    assert [s[0] for s in seen] == [1, 3, 1, 3]
    first = atom_seed(0, 0, 0, 1)
    assert seen[0][1] == first
    assert seen[0][2] == torch.rand(1, generator=torch.Generator().manual_seed(first)).item()
    assert seen[2][1] == atom_seed(0, 0, 8, 1)  # the second batch starts at global position 8


def prepared(world: int = 2, rank: int = 0, samples: int = SAMPLES, batch: int = 4, **kw) -> tuple:
    dist = faccel.DistState.simulated(rank=rank, world_size=world, **kw)
    loader = faccel.prepare(dist, DataLoader(torch.utils.data.TensorDataset(torch.ones(samples, 6)), batch))
    return dist, loader


@pytest.mark.parametrize(
    ("world", "atoms", "samples", "batch", "expected"),
    [
        (2, 3, SAMPLES, 4, "atoms must be a power of two"),
        (2, 0, SAMPLES, 4, "atoms must be a power of two"),
        (4, 2, SAMPLES, 4, "must be a power of two that divides atoms=2"),
        (3, 3, 63, 4, "atoms must be a power of two"),
        (2, 8, SAMPLES, 2, "must split into atoms / ranks = 4 equal atoms"),
        (2, 4, 9, 2, r"repeats 1 sample\(s\)"),
        (2, 4, 10, 2, "last batch would hold 2 samples"),
    ],
)
def test_a_split_that_would_differ_by_size_is_refused_before_any_batch(
    world: int, atoms: int, samples: int, batch: int, expected: str
) -> None:
    dist, loader = prepared(world, samples=samples, batch=batch)
    with pytest.raises(ArgumentValueError, match=expected):
        next(faccel.micro_batches(dist, loader, atoms=atoms, model=model()))


def test_fsdp_tensor_parallelism_and_a_bare_loader_are_refused_by_name() -> None:
    dist, loader = prepared(strategy="fsdp")
    with pytest.raises(UsageError, match="FSDP2 reduce-scatters"):
        next(faccel.micro_batches(dist, loader, atoms=4, model=model()))
    dist, loader = prepared(4, layout=faccel.Layout(replicate=2, tensor=2))
    with pytest.raises(UsageError, match="tensor parallelism and pipelines"):
        next(faccel.micro_batches(dist, loader, atoms=4, model=model()))
    dist, loader = prepared(4, layout=faccel.Layout(expert=4))
    with pytest.raises(UsageError, match="exact mode does not cover expert parallelism"):
        next(faccel.micro_batches(dist, loader, atoms=4, model=model()))
    dist = faccel.DistState()
    with pytest.raises(ArgumentError, match=r"loader faccel\.prepare"):
        next(faccel.micro_batches(dist, [torch.ones(2)], atoms=2, model=model()))
    with pytest.raises(ArgumentError, match="needs model="):
        next(faccel.micro_batches(dist, [torch.ones(2)], atoms=2))
    with pytest.raises(ArgumentError, match="needs atoms="):
        next(faccel.micro_batches(dist, [torch.ones(2)], model=model()))


def test_cuda_without_deterministic_algorithms_is_refused() -> None:
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(UsageError, match="use_deterministic_algorithms"):
        _agree(faccel.DistState(device="cuda:0", backend="nccl"), 4, failed=False)


def test_zeroing_inside_a_step_or_skipping_a_backward_is_refused() -> None:
    dist, loader = prepared(1, batch=8, accumulation_steps=2)  # each atom in two pieces
    net = model()
    batches = faccel.micro_batches(dist, loader, atoms=4, model=net)
    for micro, (x,) in batches:
        faccel.backward(dist, net(x).sum(), micro=micro)
        net.zero_grad()  # between two pieces of one atom: the first piece's gradient would be lost
        with pytest.raises(UsageError, match="zero_grad"):
            micro2, (x2,) = next(batches)
            faccel.backward(dist, net(x2).sum(), micro=micro2)
        break
    batches = faccel.micro_batches(dist, loader, atoms=4, model=net)
    next(batches)
    with pytest.raises(UsageError, match=r"must go through faccel\.backward"):
        next(batches)


@pytest.mark.parametrize("who", ["optimizer", "model"])
@pytest.mark.parametrize("where", ["first piece", "second piece"])
def test_zeroing_in_place_inside_a_step_is_refused(who: str, where: str) -> None:
    """zero_grad(set_to_none=False) keeps each .grad object and writes zeros into it: still refused."""
    dist, loader = prepared(1, batch=8, accumulation_steps=2)
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    zero = optimizer.zero_grad if who == "optimizer" else net.zero_grad
    batches = faccel.micro_batches(dist, loader, atoms=4, model=net)
    micro, (x,) = next(batches)
    if where == "second piece":
        faccel.backward(dist, net(x).sum(), micro=micro)
        micro, (x,) = next(batches)
    zero(set_to_none=False)
    with pytest.raises(UsageError, match=r"zero_grad\(set_to_none=False\)"):
        faccel.backward(dist, net(x).sum(), micro=micro)
    batches.close()
    # after optimizer_step it is the user's: the next step starts from its own buffers
    for micro, (x,) in faccel.micro_batches(dist, loader, atoms=4, model=net):
        faccel.backward(dist, net(x).sum(), micro=micro)
        if micro.sync:
            faccel.optimizer_step(dist, optimizer)
            zero(set_to_none=False)


def test_with_the_mode_off_a_micro_step_is_what_it_was() -> None:
    dist = faccel.DistState(accumulation_steps=2)
    steps = [m for m, _ in faccel.micro_batches(dist, "abc")]
    assert [m.atom for m in steps] == [None] * 3
    assert [(m.index, m.sync, m.group_size) for m in steps] == [(0, False, 2), (1, True, 2), (2, True, 1)]


def test_a_later_iteration_reuses_the_runs_buffers_and_gives_the_same_bits() -> None:
    """The buffers live in dist.runtime: epoch 2 allocates none, and its step equals a fresh run's."""

    def one_step(dist: faccel.DistState, net: nn.Module, loader: object) -> tuple[set[int], torch.Tensor]:
        for micro, (x, y) in faccel.micro_batches(dist, loader, atoms=4, model=net):
            faccel.backward(dist, nn.functional.mse_loss(net(x), y), micro=micro)
            if micro.sync:
                grads = [p.grad for p in net.parameters()]
                assert all(g is not None for g in grads)
                storages = {g.untyped_storage().data_ptr() for g in grads}  # type: ignore[union-attr]
                return storages, torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]
        raise AssertionError("no step")

    dist = faccel.DistState()
    net = model()
    loader = faccel.prepare(dist, DataLoader(data(), batch_size=16))
    first, _ = one_step(dist, net, loader.at(epoch=0))
    pool = dist.runtime.exact[net]
    held = first | {b[0].untyped_storage().data_ptr() for b in pool.free}
    second, grads = one_step(dist, net, loader.at(epoch=1))
    assert second <= held  # the sum landed in a buffer of the first iteration
    fresh = faccel.DistState()
    other = model()
    _, expected = one_step(fresh, other, faccel.prepare(fresh, DataLoader(data(), batch_size=16)).at(epoch=1))
    assert torch.equal(grads.view(torch.uint8), expected.view(torch.uint8))
    faccel.shutdown(dist)
    assert not dist.runtime.exact  # shutdown drops them


def test_a_parameter_no_atom_uses_holds_minus_zero() -> None:
    """A parameter no atom reaches keeps the -0.0 of its buffers: the sum holds -0.0, not +0.0 or None."""
    dist = faccel.DistState()
    net = nn.ModuleDict({"used": nn.Linear(6, 1), "unused": nn.Linear(2, 2)})
    loader = faccel.prepare(dist, DataLoader(data(), batch_size=16))
    for micro, (x, y) in faccel.micro_batches(dist, loader, atoms=4, model=net):
        faccel.backward(dist, nn.functional.mse_loss(net["used"](x), y), micro=micro)
        if micro.sync:
            break
    grad = net["unused"].weight.grad
    minus_zero = torch.full((2, 2), -0.0).view(torch.int32)
    assert grad is not None and torch.equal(grad.view(torch.int32), minus_zero)
    used = net["used"].weight.grad
    assert used is not None and bool(used.abs().sum() > 0)
