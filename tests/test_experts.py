"""Expert parallelism in one process: the dispatch plan's laws (every assignment sent once and back in
its place, each expert's rows those one process would give it, for any routing and any split of the
experts), the contract a model's experts meet, and the load-balancing options."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from tests.budget import EXPERT_MOVES
from tests.strategies import routings


def _exchange(outgoing: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """An all-to-all in one process: ``outgoing[src][dst]`` arrives as ``incoming[dst][src]``."""
    return [[outgoing[src][dst] for src in range(len(outgoing))] for dst in range(len(outgoing))]


def _simulate(case: dict) -> tuple[list[torch.Tensor], list[dict[int, list[tuple[int, int, int]]]], list]:
    """Every rank's dispatch of its assignments' ids, each expert applied, and the way back.

    Rows are ``(rank, assignment, expert)`` ids; each expert returns its row's id with its own mark,
    so the result shows who computed what, and where it came back to.
    """
    from faccel._loop._strategies._experts._plan import dispatch_plan, inverse, receive_plan

    num_experts, ranks = case["num_experts"], case["ranks"]
    local = num_experts // ranks
    plans = [
        dispatch_plan(index, num_experts=num_experts, ranks=ranks, capacity=case["capacity"])
        for index in case["indices"]
    ]
    ids = []
    for rank, (index, plan) in enumerate(zip(case["indices"], plans, strict=True)):
        flat = index.reshape(-1)
        rows = torch.stack([torch.full_like(flat, rank), torch.arange(flat.numel()), flat], dim=1)
        ids.append(rows[plan.order])
    sent = [list(torch.split(rows, plan.send_splits)) for rows, plan in zip(ids, plans, strict=True)]
    counts = _exchange([list(plan.cells.view(ranks, local, case["top_k"])) for plan in plans])
    arrived = _exchange(sent)
    seen: list[dict[int, list[tuple[int, int, int]]]] = []
    back_out = []
    for dst in range(ranks):
        receive = receive_plan(torch.stack(counts[dst]))
        rows = torch.cat(arrived[dst]) if arrived[dst] else torch.empty(0, 3, dtype=torch.int64)
        assert receive.recv_splits == [len(chunk) for chunk in arrived[dst]]
        grouped = rows[receive.order]
        assert (grouped[:, 2] - dst * local).tolist() == receive.experts.tolist()  # each row's local expert
        by_expert = torch.split(grouped, receive.expert_counts)
        seen.append({dst * local + e: [tuple(r) for r in rows.tolist()] for e, rows in enumerate(by_expert)})
        computed = grouped.clone()
        computed[:, 2] = computed[:, 2] * 1000 + dst  # each expert marks its row with its rank
        back_out.append(list(torch.split(computed[inverse(receive.order)], receive.recv_splits)))
    returned = _exchange(back_out)
    results = []
    for rank, plan in enumerate(plans):
        rows = torch.cat(returned[rank]) if returned[rank] else torch.empty(0, 3, dtype=torch.int64)
        full = torch.full((case["indices"][rank].numel(), 3), -1, dtype=torch.int64)
        full[plan.order] = rows
        results.append(full)
    return results, seen, plans


@settings(max_examples=40, deadline=None)
@given(routings())
def test_every_assignment_is_sent_once_and_comes_back_to_its_place(case: dict) -> None:
    results, seen, plans = _simulate(case)
    local = case["num_experts"] // case["ranks"]
    for rank, (index, plan, result) in enumerate(zip(case["indices"], plans, results, strict=True)):
        flat = index.reshape(-1)
        kept = torch.zeros(flat.numel(), dtype=torch.bool)
        kept[plan.order] = True
        # each kept assignment comes back to its own place, computed by its expert's rank, once
        assert result[kept, 0].tolist() == [rank] * int(kept.sum())
        assert result[kept, 1].tolist() == torch.nonzero(kept).flatten().tolist()
        assert result[kept, 2].tolist() == (flat[kept] * 1000 + flat[kept] // local).tolist()
        # a dropped one never left (it comes back as the caller's zeros)
        assert (result[~kept] == -1).all()
        assert plan.dropped == int((~kept).sum()) == int((plan.routed - plan.counts).sum())
        if case["capacity"] is None:
            assert plan.dropped == 0
        else:
            assert int(plan.counts.max()) <= case["capacity"]
            # the kept ones are each expert's first: first choices before second ones, each in token order
            by_slot = index.t().reshape(-1)
            for e in range(case["num_experts"]):
                mine = torch.nonzero(by_slot == e).flatten()  # in (slot, token) order
                assignment = (mine % index.shape[0]) * case["top_k"] + mine // max(index.shape[0], 1)
                assert kept[assignment].tolist() == [i < case["capacity"] for i in range(mine.numel())]
    # the experts together saw every kept assignment once
    everything = sorted(row for rows in seen for expert in rows.values() for row in expert)
    assert len(everything) == len(set(everything)) == sum(int(p.counts.sum()) for p in plans)


@settings(max_examples=30, deadline=None)
@given(routings())
def test_each_expert_sees_the_rows_one_process_would_give_it(case: dict) -> None:
    from faccel._loop._strategies._experts._plan import dispatch_plan

    case = {**case, "capacity": None}
    _, seen, _ = _simulate(case)
    # one process holding every rank's batch, rank 0's tokens first
    offsets = torch.tensor([0, *[int(i.numel()) for i in case["indices"]]]).cumsum(0).tolist()
    whole = torch.cat(case["indices"])
    one = dispatch_plan(whole, num_experts=case["num_experts"], ranks=1)
    # ... whose expert rows are transformers' own: by slot, then token (torch.where over the [k, T] mask)
    for expert, rows in enumerate(torch.split(one.order, one.counts.tolist())):
        slot, token = torch.where((whole == expert).t())
        assert rows.tolist() == (token * case["top_k"] + slot).tolist()
    by_expert = torch.split(one.order, one.counts.tolist())
    for rows in seen:
        for expert, got in rows.items():
            assert [offsets[r] + a for r, a, _ in got] == by_expert[expert].tolist()
            assert {e for _, _, e in got} <= {expert}


@pytest.mark.parametrize(("experts", "ranks"), [(8, 3), (4, 8), (0, 1)])
def test_a_group_that_does_not_divide_the_experts_is_refused_by_name(experts: int, ranks: int) -> None:
    import faccel
    from faccel._loop._strategies._experts._plan import dispatch_plan

    with pytest.raises(faccel.errors.ArgumentValueError, match="must divide the number of experts"):
        dispatch_plan(torch.zeros(2, 1, dtype=torch.int64), num_experts=experts, ranks=ranks)


def _mixtral_block(implementation: str | None) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.1)
    return block


def _plain_block() -> torch.nn.Module:
    from tests.distributed.experts_workers import Block

    torch.manual_seed(0)
    return Block(experts=4, hidden=16)


@pytest.mark.filterwarnings("ignore::UserWarning")  # transformers: a standalone experts module
@pytest.mark.parametrize(
    "implementation",
    [
        "plain",
        pytest.param("eager", marks=EXPERT_MOVES),  # transformers' import: 15 s here
        pytest.param("batched_mm", marks=EXPERT_MOVES),
    ],
)
def test_the_dispatch_with_every_expert_here_is_bitwise_the_models_own_forward(implementation: str) -> None:
    import copy

    import faccel

    block = _plain_block() if implementation == "plain" else _mixtral_block(implementation)
    reference = copy.deepcopy(block)
    dist = faccel.detect({})
    assert faccel.prepare(dist, block, experts=["experts"]) is block  # one process: no wrapper
    assert list(block.state_dict()) == list(reference.state_dict())
    shape = (10, 16) if implementation == "plain" else (2, 5, 16)
    x, grad = torch.randn(shape), torch.randn(shape)
    out, want = block(x), reference(x)
    assert torch.equal(out, want)
    out.backward(grad)
    want.backward(grad)
    for (name, mine), theirs in zip(block.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad), name
    load = faccel.expert_load(dist)["experts"]
    assert sum(load["routed"]) == 20 and load["dropped"] == 0 and load["world_routed"] == load["routed"]


def test_a_capacity_drops_and_counts_what_is_past_it() -> None:
    import faccel

    block = _plain_block()
    torch.nn.init.zeros_(block.gate.weight)  # every token to the same two experts
    dist = faccel.detect({})
    faccel.prepare(dist, block, expert_capacity=1.0)  # found by the search: the experts module
    out = block(torch.randn(8, 16))
    load = faccel.expert_load(dist)["experts"]
    # 16 assignments, 4 experts: each keeps ceil(16 / 4) = 4; two experts got 8 each
    assert sorted(load["routed"]) == [0, 0, 8, 8] and load["dropped"] == 8
    assert out.shape == (8, 16)


def test_an_experts_module_is_found_or_named_and_a_wrong_one_refused_by_name() -> None:
    import faccel
    from faccel._loop._strategies._experts._find import find_experts

    with pytest.raises(faccel.errors.PrepareError, match="no submodule of the Linear holds experts"):
        find_experts(torch.nn.Linear(2, 2))
    with pytest.raises(faccel.errors.PrepareError, match="names 'nope', which is no submodule"):
        find_experts(torch.nn.Linear(2, 2), ["nope"])
    with pytest.raises(faccel.errors.PrepareError, match="has no int attribute num_experts"):
        find_experts(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["0"])
    with pytest.raises(faccel.errors.ArgumentValueError, match="expert_capacity is a capacity factor"):
        faccel.prepare(faccel.detect({}), torch.nn.Linear(2, 2), expert_capacity=0)


def test_the_balancing_loss_and_the_loss_free_bias() -> None:
    import faccel

    logits = torch.randn(6, 4, requires_grad=True)
    loss = faccel.load_balancing_loss(logits, torch.topk(logits, 2).indices, 4)
    loss.backward()
    assert loss.item() > 0 and logits.grad is not None  # through the router's probabilities
    bias = faccel.update_expert_bias(torch.zeros(4), [4, 0, 2, 2], rate=0.5)
    assert bias.tolist() == [-0.5, 0.5, 0.0, 0.0]


def test_the_memory_plan_counts_each_expert_rank_its_block() -> None:
    import faccel
    from faccel._report._memory_arith import rank_bytes
    from faccel._report._memory_build import param_specs

    with torch.device("meta"):
        block = _mixtral_block_meta()
    specs = {spec.name: spec for spec in param_specs(block)}
    assert specs["experts.gate_up_proj"].expert and not specs["gate.weight"].expert
    for name, spec in specs.items():
        whole = rank_bytes(spec, faccel.Layout(), 0)
        split = [rank_bytes(spec, faccel.Layout(expert=2), rank) for rank in range(2)]
        assert split == ([whole // 2] * 2 if spec.expert else [whole] * 2), name


def _mixtral_block_meta() -> torch.nn.Module:
    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = torch.nn.Parameter(torch.empty(4, 8, 4))
            self.down_proj = torch.nn.Parameter(torch.empty(4, 4, 4))

    block = torch.nn.Module()
    block.gate = torch.nn.Linear(4, 4, bias=False)
    block.experts = Experts()
    return block


def test_expert_parallelism_beside_context_ranks_or_replicas_under_ddp_is_refused_by_name() -> None:
    import faccel
    from faccel._loop._strategies._experts._dispatch import shard_experts

    # DDP leaves each rank's experts alone, so it cannot average a block over the replicas holding it
    replicas = faccel.Layout(replicate=2, expert=2)
    with pytest.raises(faccel.errors.LaunchError, match="averages experts over replicas"):
        faccel.DistState.simulated(world_size=4, layout=replicas, strategy="ddp")
    assert faccel.DistState.simulated(world_size=4, layout=replicas).strategy == "fsdp"
    grid = faccel.Layout(expert=2, context=2)
    dist = faccel.DistState.simulated(rank=0, world_size=4, layout=grid, strategy="fsdp")
    with pytest.raises(faccel.errors.PrepareError, match="combines expert parallelism with"):
        shard_experts(dist, _mixtral_block_meta(), names=None, capacity_factor=None)


def test_experts_in_pipeline_stages_cut_by_module_names_are_refused_by_name() -> None:
    """A stage cut by names is traced; the traced stage would never call the dispatch forward."""
    import faccel
    from faccel._loop._options import PrepareOptions
    from faccel._loop._strategies._pipeline._stages import pipelined

    grid = faccel.Layout(pipeline=2, expert=2)
    dist = faccel.DistState.simulated(rank=0, world_size=4, layout=grid, strategy="fsdp")
    model = torch.nn.Sequential(_mixtral_block_meta(), _mixtral_block_meta())
    with pytest.raises(faccel.errors.PrepareError, match="give split= a function build"):
        pipelined(dist, model, PrepareOptions(split=("1",)))
    # with a split function, the whole model's experts are found at prepare, for each stage to split
    piped = pipelined(dist, model, PrepareOptions(split=lambda stage, stages: model[stage]))
    assert piped._options.experts == ("0.experts", "1.experts")
