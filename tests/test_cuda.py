"""CUDA paths on one GPU: device placement, mixed precision, exact resume, saved models, functional.

Marked ``cuda`` and skipped without a GPU; ``scripts/check_cuda.sh`` runs them (and, on a machine
with several GPUs, a torchrun job over NCCL) in one step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _task(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def test_detect_picks_the_gpu_and_nccl() -> None:
    import faccel

    dist = faccel.detect({})
    assert dist.device == torch.device("cuda", 0)
    launched = faccel.state_from_env(
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"},
        cuda_count=torch.cuda.device_count(),
    )
    assert launched.backend == "nccl" and launched.device == torch.device("cuda", 0)


def test_prepare_moves_the_model_and_pinned_batches_to_the_gpu() -> None:
    import faccel

    dist = faccel.detect({})
    x, y = _task()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, pin_memory=True)
    model, loader = faccel.prepare(dist, _model(), loader)
    assert loader.non_blocking
    for inputs, targets in loader.at(epoch=0):
        assert inputs.device.type == targets.device.type == "cuda"
    assert next(model.parameters()).device.type == "cuda"
    nested = faccel.to_device({"a": [x[:2], ("id", y[:2])]}, dist.device)
    assert nested["a"][0].is_cuda and nested["a"][1][1].is_cuda and nested["a"][1][0] == "id"


def _train(dist: object, steps: int) -> list[float]:
    """Losses of ``steps`` applied optimizer steps (fp16 steps the scaler skips are not counted)."""
    import faccel

    x, y = _task()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    scaler = faccel.grad_scaler(dist)
    losses: list[float] = []
    for _ in range(5 * steps):  # fp16: a step whose gradients overflow is skipped, and the scale shrinks
        optimizer.zero_grad()
        batch = slice(len(losses) % 4 * 16, len(losses) % 4 * 16 + 16)
        loss = torch.nn.functional.mse_loss(model(x[batch].cuda()), y[batch].cuda())
        faccel.backward(dist, loss, scaler=scaler)
        if faccel.optimizer_step(dist, optimizer, scaler=scaler):
            losses.append(loss.item())
        if len(losses) == steps:
            return losses
    raise AssertionError(f"only {len(losses)} of {5 * steps} steps were applied")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_close_to_fp32(precision: str) -> None:
    import faccel

    full = _train(faccel.detect({}), steps=20)
    mixed = _train(faccel.detect({}, precision=precision), steps=20)
    assert mixed[-1] < mixed[0] * 0.5
    assert mixed[-1] == pytest.approx(full[-1], rel=0.1, abs=0.05)


def test_a_resumed_run_matches_one_that_never_stopped_bitwise(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    x, y = _task()

    def run(stop: int | None, resume: bool) -> list[torch.Tensor]:
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
        model, optimizer, loader = faccel.prepare(dist, model, optimizer, loader)
        state = faccel.TrainState.create(model=model, optimizer=optimizer)
        if resume:
            state = faccel.restore(dist, state, tmp_path)
        step = state.step
        for epoch in range(state.epoch, 3):
            start = state.position if epoch == state.epoch else 0
            for position, (inputs, targets) in enumerate(loader.at(epoch=epoch, start=start), start=start):
                optimizer.zero_grad()
                noise = torch.randn_like(inputs) * 0.01  # the CUDA generator is part of the state
                faccel.backward(dist, torch.nn.functional.mse_loss(model(inputs + noise), targets))
                optimizer.step()
                step += 1
                if step == stop:
                    saved = faccel.TrainState.create(
                        model=model, optimizer=optimizer, step=step, epoch=epoch, position=position + 1
                    )
                    faccel.checkpoint(dist, saved, tmp_path)
                    return []
        return [p.detach().cpu() for p in model.parameters()]

    straight = run(stop=None, resume=False)
    run(stop=6, resume=False)
    resumed = run(stop=None, resume=True)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


def test_save_model_and_load_model_round_trip_gpu_weights(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    model = faccel.prepare(dist, _model())
    faccel.save_model(dist, model, tmp_path / "model")
    fresh = _model().cuda()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    faccel.load_model(dist, fresh, tmp_path / "model")
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert b.is_cuda and torch.equal(a, b)


def test_functional_adamw_matches_torch_on_the_gpu() -> None:
    import faccel

    dist = faccel.detect({})
    x, y = _task()
    model = _model().cuda()
    reference = _model().cuda()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, foreach=False)
    params, buffers = faccel.func.model_params(dist, model)
    opt = faccel.func.adamw(lr=0.01)
    state = opt.init(params)
    grad_fn = faccel.func.loss_and_grad(dist, model, torch.nn.functional.mse_loss)
    for _ in range(5):
        _, grads = grad_fn(params, buffers, x.cuda(), y.cuda())
        params, state = opt.update(grads, state, params)
        torch_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x.cuda()), y.cuda()).backward()
        torch_opt.step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-6, atol=1e-7)


def test_trackers_any_rank_and_legacy_weights_on_the_gpu(tmp_path: Path) -> None:
    import json

    import faccel

    dist = faccel.detect({})
    loss = torch.tensor(0.25, device=dist.device)
    with faccel.init_tracker(dist, tmp_path / "run") as tracker:
        faccel.log(dist, tracker, 1, {"loss": loss}, reduce="mean")
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert (record["metrics"]["loss"], record["source"]) == (0.25, "mean over 1 rank")
    assert faccel.any_rank(dist, torch.isnan(loss)) is False
    source = _model()
    torch.save(source.state_dict(), tmp_path / "pytorch_model.bin")
    target = faccel.prepare(dist, _model())
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    faccel.load_model(dist, target, tmp_path)
    for a, b in zip(source.parameters(), target.parameters(), strict=True):
        assert b.is_cuda and torch.equal(a, b.cpu())


# Inductor warns of torch.jit's deprecation inside torch itself (torch 2.11), and advises TF32
# for float32 matrix products: torch's own messages, not faccel's.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")
def test_torch_compile_with_inductor_on_the_gpu(tmp_path: Path) -> None:
    import time

    import faccel

    dist = faccel.detect({})
    x, _ = _task()
    eager = faccel.prepare(dist, _model())
    compiled = torch.compile(faccel.prepare(dist, _model()))
    started = time.perf_counter()
    out = compiled(x.cuda())
    print(f"inductor on the GPU: first forward {time.perf_counter() - started:.1f} s")
    torch.testing.assert_close(out, eager(x.cuda()), rtol=1e-4, atol=1e-5)
    faccel.save_model(dist, compiled, tmp_path / "model")
    assert (tmp_path / "model" / "model.safetensors").exists()


def test_activation_checkpointing_on_the_gpu_keeps_the_gradients_and_lowers_the_peak() -> None:
    """One GPU: the CUDA generator is preserved too (dropout), and the step's peak allocation drops.

    Close, not bitwise: CUDA's embedding backward adds with atomics, in no fixed order.
    """
    import faccel
    from tests.distributed.meta_workers import Block, TinyGPT

    dist = faccel.detect({})
    tokens = (torch.arange(8 * 256).reshape(8, 256) % 11).to(dist.device)
    grads, peaks = [], []
    for selector in (None, Block):
        torch.manual_seed(0)
        model = faccel.prepare(dist, TinyGPT(width=256, depth=4), activation_checkpointing=selector)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.manual_seed(1)  # the dropout masks, drawn on the GPU
        faccel.backward(dist, model(tokens).float().square().mean())
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert peaks[1] < 0.7 * peaks[0], peaks


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (FSDP2 over NCCL)")
def test_fsdp2_cpu_offload_keeps_the_shards_on_the_cpu_and_the_gradients(tmp_path: Path) -> None:
    from tests.distributed import harness, meta_workers

    ranks = harness.run(meta_workers.cuda_policies_run, world_size=2, timeout=180, root=str(tmp_path))
    for rank, r in enumerate(ranks):
        assert r["device"] == f"cuda:{rank}"
        assert r["fsdp"]["sharded_devices"] == r["fsdp"]["grad_devices"] == ["cuda"]
        # offload: the shards and their gradients on the CPU; the block computed on the GPU
        assert r["fsdp_offload"]["sharded_devices"] == r["fsdp_offload"]["grad_devices"] == ["cpu"]
        for case in ("fsdp_offload", "fsdp_keep", "fsdp_ac"):
            for name, grad in r["fsdp"]["grads"].items():
                got = torch.tensor(r[case]["grads"][name])
                torch.testing.assert_close(
                    got, torch.tensor(grad), rtol=1e-5, atol=1e-6, msg=f"{case} {name}"
                )
            assert r[case]["saved"] == r["fsdp"]["saved"], case
        assert r["fsdp_ac"]["checkpointed"] == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize(
    ("precision", "offload"),
    [("bf16", False), ("fp16", False), ("bf16", True)],
    ids=["bf16", "fp16", "offload"],
)
def test_deepspeed_on_the_gpu_resumes_bitwise(tmp_path: Path, precision: str, offload: bool) -> None:
    # DeepSpeed's GPU path (DS_ACCELERATOR=cuda, NCCL) on one GPU, ZeRO-2: a stop at step 6 and a
    # resume end bitwise equal to the uninterrupted run; the checkpoint is safetensors and JSON only.
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'faccel[deepspeed]')")
    from tests.distributed import deepspeed_workers, harness

    (result,) = harness.run(
        deepspeed_workers.stop_and_resume,
        world_size=1,
        timeout=600,
        stage=2,
        root=str(tmp_path),
        precision=precision,
        accelerator="cuda",
        offload=offload,
    )
    assert result["restored_step"] == 6 and result["ended_step"] == 9
    assert result["resumed"] == result["uninterrupted"]
    assert result["after_restore"] == result["saved"]
    assert all(name.endswith((".safetensors", ".json")) for name in result["files"]), result["files"]
    if precision == "fp16":
        assert result["scaler"]["restored"] == result["scaler"]["saved"]


def test_the_meter_on_the_gpu_reads_the_allocators_peak_and_an_mfu_against_the_devices_peak() -> None:
    """A small transformer's steps on the GPU: MFU from the 6N + attention formula against the
    table's peak for this device (fp32), and the CUDA allocator's peak as the memory."""
    import faccel
    from faccel._report._flops import device_peak_flops

    dist = faccel.detect({})
    torch.manual_seed(0)
    width, layers, seq, batch = 512, 4, 256, 16
    layer = torch.nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    flops = faccel.transformer_flops(params=params, layers=layers, width=width, seq_len=seq)
    meter = faccel.start_meter(dist, flops_per_item=flops, flops_source="formula")
    x = torch.randn(batch, seq, width, device=dist.device)
    for _ in range(5):
        faccel.backward(dist, model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        meter = faccel.measure(dist, meter, items=batch * seq)
    name = torch.cuda.get_device_name(0)
    peak = device_peak_flops(name, "fp32")
    print(f"{name}: peak {peak}, {meter.metrics()}")
    assert meter.spec.memory_source == "cuda" and meter.spec.peak_flops == peak
    assert meter.memory_bytes is not None and meter.memory_bytes >= torch.cuda.memory_allocated()
    if peak is not None:  # a device of the table: an MFU, and a physical one
        assert meter.mfu is not None and 0 < meter.mfu < 1


class _Experts(torch.nn.Module):
    """An experts module under faccel's contract: stacked weights, each expert's rows by slot."""

    def __init__(self, experts: int, hidden: int, device: str) -> None:
        super().__init__()
        self.num_experts = experts
        self.up = torch.nn.Parameter(torch.randn(experts, 2 * hidden, hidden, device=device) / hidden**0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, hidden, 2 * hidden, device=device) / hidden**0.5)

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in range(self.num_experts):
            slot, token = torch.where(index.t() == expert)
            rows = torch.relu(hidden[token] @ self.up[expert].t()) @ self.down[expert].t()
            out = out.index_add(0, token, rows * weights[token, slot, None])
        return out


def experts_dispatch_is_the_modules_own_forward(device: str = "cuda") -> None:
    """Expert parallelism's dispatch (one process: every expert here, no all-to-all) gives the experts
    module's own forward, bitwise: the same rows to each expert, summed in the same order."""
    import copy

    import faccel

    torch.manual_seed(0)
    experts, hidden, tokens = 8, 64, 128
    holder = torch.nn.ModuleDict({"experts": _Experts(experts, hidden, device)})
    plain = copy.deepcopy(holder["experts"])
    faccel.prepare(faccel.detect({}, device=device), holder, experts=["experts"])
    x = torch.randn(tokens, hidden, device=device)
    weights, index = torch.topk(torch.softmax(torch.randn(tokens, experts, device=device), -1), 2, dim=-1)
    torch.testing.assert_close(holder["experts"](x, index, weights), plain(x, index, weights), rtol=0, atol=0)


def test_the_experts_dispatch_on_the_gpu_is_the_modules_own_forward() -> None:
    experts_dispatch_is_the_modules_own_forward("cuda")
