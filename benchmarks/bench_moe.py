"""Expert parallelism: a Mixtral-like layer at expert=2 through faccel vs the dispatch by hand, vs FSDP2.

Two gloo processes. Each rank builds the same layer (a router and 8 two-matrix experts, hidden
256, expert width 512, their weights stacked along dim 0: faccel's experts contract) three
ways: through ``faccel.detect(layout="expert=2")`` and ``faccel.prepare`` (each rank keeps 4
experts; tokens travel by ``all_to_all_single``); the same dispatch written by hand (route,
counts all-to-all, tokens all-to-all with uneven splits, the 4 local experts, the reverse
all-to-all, the router-weighted combine, the router's gradient all-reduced by hand; the local
experts run by the same experts module's forward, over this rank's 4 experts, as faccel runs
them, so the two differ only in what surrounds it); and
FSDP2 over the 2 ranks without expert parallelism (``fully_shard``: every expert's weights
all-gathered at every forward and backward). One training step (forward, backward, SGD) is
timed, in blocks that alternate between the three, every rank starting each block together;
rank 0's figures. Memory: each way's peak resident set size per rank over a few steps, each in
processes of its own, minus the size before the model was built (after the same imports and the
DeviceMesh, in every way's processes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from benchmarks.common import FACCEL, Peak, Row, interleave, per_call, rank_env, rows, rss_bytes, run_ranks

HAND = "dispatch by hand"
FSDP = "FSDP2, no expert parallelism"
EXPERTS, TOP_K, HIDDEN, WIDTH, TOKENS = 8, 2, 256, 512, 512


def _layer(experts: int = EXPERTS) -> Any:
    import torch

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = experts
            self.up = torch.nn.Parameter(torch.randn(experts, WIDTH, HIDDEN) / HIDDEN**0.5)
            self.down = torch.nn.Parameter(torch.randn(experts, HIDDEN, WIDTH) / WIDTH**0.5)

        def forward(self, hidden: Any, index: Any, weights: Any) -> Any:
            out = torch.zeros_like(hidden)
            for expert in range(self.num_experts):
                slot, token = torch.where(index.t() == expert)
                rows = torch.relu(hidden[token] @ self.up[expert].t()) @ self.down[expert].t()
                out = out.index_add(0, token, rows * weights[token, slot, None])
            return out

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
            self.experts = Experts()

        def forward(self, x: Any) -> Any:
            weights, index = torch.topk(torch.softmax(self.gate(x), dim=-1), TOP_K, dim=-1)
            return self.experts(x, index, weights / weights.sum(dim=-1, keepdim=True))

    torch.manual_seed(0)
    return Layer()


class _ByHand:
    """The same dispatch, written by hand: rank r holds experts [4r, 4r + 4)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as tdist

        whole = _layer()
        self.rank, self.ranks = tdist.get_rank(), tdist.get_world_size()
        self.local = EXPERTS // self.ranks
        first = self.rank * self.local
        self.gate = whole.gate
        self.experts = whole.experts  # this rank's 4 experts only
        self.experts.num_experts = self.local
        self.up = self.experts.up = torch.nn.Parameter(
            whole.experts.up.detach()[first : first + self.local].clone()
        )
        self.down = self.experts.down = torch.nn.Parameter(
            whole.experts.down.detach()[first : first + self.local].clone()
        )
        self.params = [self.gate.weight, self.up, self.down]

    def __call__(self, x: Any) -> Any:
        import torch
        import torch.distributed as tdist
        from torch.distributed.nn.functional import all_to_all_single

        weights, index = torch.topk(torch.softmax(self.gate(x), dim=-1), TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = index.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=EXPERTS)
        counts_in = torch.empty_like(counts)
        tdist.all_to_all_single(counts_in, counts)
        send = counts.view(self.ranks, self.local).sum(1).tolist()
        per_source = counts_in.view(self.ranks, self.local)
        recv = per_source.sum(1).tolist()
        rows = x[order // TOP_K]
        got = all_to_all_single(x.new_empty(sum(recv), HIDDEN), rows, recv, send)
        expert_of = torch.arange(self.local).repeat(self.ranks).repeat_interleave(per_source.reshape(-1))
        by_expert = torch.sort(expert_of, stable=True).indices
        grouped = got[by_expert]
        ids = expert_of[by_expert]
        done = self.experts(grouped, ids[:, None], torch.ones(len(ids), 1))[torch.argsort(by_expert)]
        back = all_to_all_single(x.new_empty(len(order), HIDDEN), done, send, recv)
        mine = torch.zeros_like(back).index_copy(0, order, back).view(-1, TOP_K, HIDDEN)
        return (mine * weights[..., None]).sum(1)

    def step(self, x: Any) -> None:
        import torch
        import torch.distributed as tdist

        self(x).square().mean().backward()
        tdist.all_reduce(self.gate.weight.grad)  # the router is data-parallel
        self.gate.weight.grad /= self.ranks
        for param in (self.up, self.down):
            param.grad /= self.ranks  # each expert's gradient holds both ranks' tokens
        with torch.no_grad():
            for param in self.params:
                param -= 1e-3 * param.grad
                param.grad = None


def _subjects(dist: Any, which: tuple[str, ...]) -> dict[str, Any]:
    import torch

    import faccel

    out: dict[str, Any] = {}
    if FACCEL in which:
        model = faccel.prepare(dist, _layer())
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step_faccel(x: Any, model: Any = model, optimizer: Any = optimizer) -> None:
            faccel.backward(dist, model(x).square().mean())
            optimizer.step()
            optimizer.zero_grad()

        out[FACCEL] = step_faccel
    if HAND in which:
        out[HAND] = _ByHand().step
    if FSDP in which:
        from torch.distributed.fsdp import fully_shard

        layer = _layer()
        fully_shard(layer.experts)
        fully_shard(layer)
        fsdp_optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)

        def step_fsdp(x: Any, layer: Any = layer, optimizer: Any = fsdp_optimizer) -> None:
            layer(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        out[FSDP] = step_fsdp
    return out


def _worker(rank: int, port: int, plan: tuple[Any, ...], out: str) -> None:
    os.environ.update(rank_env(rank, port))
    import torch
    import torch.distributed as tdist

    import faccel

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    mode, rounds, calls, which = plan
    dist = faccel.detect(layout="expert=2")
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1 + rank))
    if mode == "memory":
        # the same imports and the mesh in every way's processes first: the model's memory, not torch's
        import torch.distributed.fsdp
        import torch.distributed.tensor

        faccel.device_mesh(dist)
        before = rss_bytes()
        with Peak() as peak:
            steps = _subjects(dist, tuple(which))
            for _ in range(calls):
                next(iter(steps.values()))(x)
        if rank == 0:
            Path(out).write_text(json.dumps(peak.peak - before))
        faccel.shutdown(dist)
        return

    def block(step: Any) -> Any:
        def timed() -> float:
            tdist.barrier()
            return per_call(lambda: step(x), calls)

        return timed

    steps = _subjects(dist, (FACCEL, HAND, FSDP))
    samples = interleave({name: block(step) for name, step in steps.items()}, rounds=rounds)
    if rank == 0:
        Path(out).write_text(json.dumps(samples))
    faccel.shutdown(dist)


def run(quick: bool) -> list[Row]:
    rounds, calls = (4, 5) if quick else (15, 20)
    samples: Any = run_ranks(_worker, ("time", rounds, calls, ()), what="expert parallelism benchmark")
    case = (
        f"Mixtral-like layer ({EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, expert width {WIDTH}), "
        f"{TOKENS} tokens a rank, expert=2 on 2 gloo processes, one SGD step"
    )
    out = rows(case, samples, baseline=HAND, unit="ms/step", scale=1e3, goals="moe")
    memory = {
        name: [run_ranks(_worker, ("memory", 0, 3, (name,)), what=f"memory of {name}") / 2**20]
        for name in (HAND, FACCEL, FSDP)
    }
    out += rows(
        "the same, peak resident memory of rank 0 over 3 steps, above its size before the model",
        memory,
        baseline=FSDP,
        unit="MiB",
        goals="moe_memory",
    )
    return out
