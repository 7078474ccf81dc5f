"""The memory plan (``faccel.estimate_memory``, ``python -m faccel plan``): its arithmetic, the meta
forward that counts activations, and the command line."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import faccel
from faccel import Layout
from faccel.__main__ import main
from faccel._report._memory_plan import (
    ParamSpec,
    activation_bytes,
    layout_plan,
    param_specs,
    parse_candidate,
    rank_bytes,
    shard_rows,
)
from faccel.errors import ArgumentError, ArgumentValueError
from tests.strategies import layout_sizes, plan_param_specs


@given(st.integers(0, 10_000), st.integers(1, 512))
def test_shard_rows_are_torch_chunks_rule_and_cover_the_rows(rows: int, parts: int) -> None:
    pieces = [shard_rows(rows, parts, i) for i in range(parts)]
    assert sum(pieces) == rows
    chunks = [len(c) for c in torch.arange(rows).chunk(parts)] if rows else []
    assert pieces[: len(chunks)] == chunks and not any(pieces[len(chunks) :])


@settings(max_examples=60, deadline=None)
@given(plan_param_specs(), layout_sizes(max_world=48))
def test_every_tensor_is_held_once_per_replica_and_the_plan_reports_the_largest_rank(
    specs: list[ParamSpec], sizes: tuple[int, int, int]
) -> None:
    layout = Layout(*sizes)
    for spec in specs:
        held = sum(rank_bytes(spec, layout, rank) for rank in range(layout.world_size))
        tensor_ranks = 1 if spec.tensor_dim is not None else layout.tensor
        assert held == spec.nbytes * layout.replicate * tensor_ranks
    plan = layout_plan(specs, layout, optimizer="adamw")
    ranks = [sum(rank_bytes(spec, layout, r) for spec in specs) for r in range(layout.world_size)]
    assert plan.parameters == max(ranks)
    trained = max(
        sum(rank_bytes(s, layout, r) for s in specs if s.trainable) for r in range(layout.world_size)
    )
    assert (plan.gradients, plan.optimizer) == (trained, 2 * trained)
    assert layout_plan(specs, layout, optimizer="sgd").optimizer == trained
    assert layout_plan(specs, layout, optimizer="none").optimizer == 0


@settings(max_examples=30, deadline=None)
@given(plan_param_specs(), st.integers(1, 64), st.integers(1, 64))
def test_fsdp_shares_sum_to_the_model_and_shrink_as_the_world_grows(
    specs: list[ParamSpec], small: int, extra: int
) -> None:
    total = sum(spec.nbytes for spec in specs)
    for world in (small, small + extra):
        shares = [sum(rank_bytes(s, Layout(shard=world), r) for s in specs) for r in range(world)]
        assert sum(shares) == total
        assert max(shares) >= total / world
    fewer, more = (layout_plan(specs, Layout(shard=w)) for w in (small, small + extra))
    assert more.parameters <= fewer.parameters and more.optimizer <= fewer.optimizer
    assert layout_plan(specs, Layout(replicate=small)).parameters == total  # DDP: the whole model


@given(layout_sizes(max_world=64))
def test_every_grid_is_a_candidate_and_the_short_names_mean_their_layouts(
    sizes: tuple[int, int, int],
) -> None:
    replicate, shard, tensor = sizes
    world = replicate * shard * tensor
    assert parse_candidate(f"{replicate}x{shard}x{tensor}", world) == Layout(*sizes)
    assert parse_candidate(str(Layout(*sizes)), world) == Layout(*sizes)
    assert parse_candidate(f"hsdp:{replicate}x{shard * tensor}", world) == Layout(replicate, shard * tensor)
    assert parse_candidate(f"tp:{tensor}", world) == Layout(shard=world // tensor, tensor=tensor)
    assert parse_candidate("ddp", world).replicate == parse_candidate("fsdp", world).shard == world


def test_ddp_holds_a_bucket_copy_of_the_gradients_and_fsdp_the_largest_unit_whole() -> None:
    specs = [
        ParamSpec("embed", (100, 8), 4, unit=""),
        ParamSpec("layers.0.w", (8, 8), 4, unit="layers.0"),
        ParamSpec("layers.1.w", (8, 8), 4, unit="layers.1", trainable=False),
    ]
    ddp = layout_plan(specs, Layout(replicate=2))
    assert ddp.in_flight == ddp.gradients == 4 * (800 + 64)
    fsdp = layout_plan(specs, Layout(shard=2))
    assert fsdp.in_flight == 2 * 3200  # the root unit's parameters and gradients, whole
    assert fsdp.total == fsdp.states + fsdp.in_flight


def test_the_tp_plan_says_which_dims_split() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    with torch.device("meta"):
        net = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8))
    plan = {"0": RowwiseParallel(), "1": ColwiseParallel(), "2": RowwiseParallel()}
    dims = {spec.name: spec.tensor_dim for spec in param_specs(net, plan)}
    assert dims == {
        "0.weight": 0,
        "1.weight": 0,
        "1.bias": 0,
        "2.weight": 1,
        "2.bias": None,
        "3.weight": None,
        "3.bias": None,
    }
    dims = {spec.name: spec.tensor_dim for spec in param_specs(net, {"0": ColwiseParallel()})}
    assert dims["0.weight"] == 1  # an embedding's colwise split is its embedding dim


def _saved_bytes_on_cpu(model: nn.Module, inputs: tuple[torch.Tensor, ...], *, math: bool = True) -> int:
    """What a real forward saves for backward, each storage once, parameters left out: by data pointer."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    from torch.nn.attention import SDPBackend, sdpa_kernel

    # The meta device has one attention kernel, the math one (it saves the softmax); the CPU's
    # flash kernel saves less. math=True: the meta device's kernel, to compare with a meta count.
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        if math:
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        model(*inputs)
    return sum(storages.values())


def _block() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(50, 16),
        nn.LayerNorm(16),
        nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True),
        nn.Linear(16, 50),
    )


def test_activations_counted_on_meta_equal_a_real_forwards_saved_tensors() -> None:
    torch.manual_seed(0)
    real = _block()
    ids = torch.randint(0, 50, (3, 7))
    with torch.device("meta"):
        meta = _block()
    counted = activation_bytes(meta, (ids,))
    assert counted == _saved_bytes_on_cpu(real, (ids,))
    assert counted > 3 * 7 * 16 * 4 * 4  # several activations of the batch, not just its input
    assert not any(p.device.type != "meta" for p in meta.parameters())  # nothing was allocated


def test_activations_counted_on_fake_tensors_equal_a_real_cpu_forwards() -> None:
    # A model built from its function is built on fake CPU tensors: the CPU's own attention
    # kernel (flash), which saves less than the math one; the count is the real forward's.
    ids = torch.randint(0, 50, (3, 7))
    plan = faccel.estimate_memory(_block, 1, ["ddp"], inputs=(ids,))
    real = _saved_bytes_on_cpu(_block(), (ids,), math=False)
    assert plan.activations == real < _saved_bytes_on_cpu(_block(), (ids,))
    assert "fake CPU tensors" in plan.activations_note


def test_estimate_memory_takes_a_function_a_path_or_a_model() -> None:
    by_function = faccel.estimate_memory(_block, 2, inputs=(torch.zeros(3, 7, dtype=torch.long),))
    by_path = faccel.estimate_memory("tests.test_memory_plan:_block", 2)
    with torch.device("meta"):
        by_model = faccel.estimate_memory(_block(), 2, ["fsdp"])
    assert by_function.parameters == by_path.parameters == by_model.parameters
    assert sum(p.numel() for p in _block().parameters()) == by_function.parameters
    assert by_function.activations and by_path.activations is None
    assert by_function.layouts[0].total - by_function.layouts[0].activations == by_path.layouts[0].total
    assert [str(row.layout) for row in by_model.layouts] == ["replicate=1,shard=2,tensor=1"]
    assert by_function.largest == ("0.weight", 50 * 16 * 4)  # the first of the two largest


def test_estimate_memory_refuses_by_name() -> None:
    with pytest.raises(ArgumentValueError, match="spans 4 ranks, but the world size is 2"):
        faccel.estimate_memory(_block, 2, [Layout(shard=4)])
    with pytest.raises(ArgumentValueError, match="optimizer must be one of"):
        faccel.estimate_memory(_block, 2, optimizer="lion")
    with pytest.raises(ArgumentValueError, match="'module:function'"):
        faccel.estimate_memory("tests.test_memory_plan", 2)
    with pytest.raises(ArgumentError, match=r"not an nn\.Module"):
        faccel.estimate_memory(lambda: 3, 2)
    with pytest.raises(ArgumentError, match="world_size"):
        faccel.estimate_memory(_block, "8")  # type: ignore[arg-type]
    with pytest.raises(ArgumentValueError, match="hsdp:RxS"):
        parse_candidate("zero3", 8)
    with pytest.raises(ArgumentValueError, match="world size is 8"):
        parse_candidate("hsdp:2x2", 8)


def test_a_forward_that_needs_real_data_is_reported_not_raised() -> None:
    class NeedsData(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) if x.sum().item() > 0 else x  # .item() on meta fails

    plan = faccel.estimate_memory(NeedsData, 1, ["ddp"], inputs=(torch.ones(2, 4),))
    assert plan.activations is None and "forward on fake CPU tensors failed" in plan.activations_note
    with torch.device("meta"):
        plan = faccel.estimate_memory(NeedsData(), 1, ["ddp"], inputs=(torch.ones(2, 4),))
    assert plan.activations is None and "forward on meta tensors (attention" in plan.activations_note
    assert (plan.layouts[0].parameters, plan.layouts[0].in_flight) == (80, 0)  # one process: no DDP buckets


@pytest.fixture(scope="module")
def gpt2_config(tmp_path_factory: pytest.TempPathFactory) -> str:
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("plan")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    config.save_pretrained(folder)
    return str(folder / "config.json")


def test_the_command_line_prints_the_plan_of_a_transformers_config(
    gpt2_config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    argv = ["plan", "--hf-config", gpt2_config, "--world-size", "4", "--layouts", "ddp,fsdp,hsdp:2x2,tp:2"]
    assert main([*argv, "--json", "--batch-size", "2", "--seq-len", "16"]) == 0
    got = json.loads(capsys.readouterr().out)
    config = AutoConfig.from_pretrained(gpt2_config.removesuffix("/config.json"))
    expected = faccel.estimate_memory(
        lambda: AutoModelForCausalLM.from_config(config),
        4,
        ["ddp", "fsdp", "hsdp:2x2", "tp:2"],
        inputs={"input_ids": torch.zeros(2, 16, dtype=torch.long)},
    )
    assert got == expected.to_dict()
    assert [row["layout"] for row in got["layouts"]] == [
        "replicate=4,shard=1,tensor=1",
        "replicate=1,shard=4,tensor=1",
        "replicate=2,shard=2,tensor=1",
        "replicate=1,shard=2,tensor=2",
    ]
    assert got["largest"]["name"] == "transformer.wte.weight" and got["activations"] > 0
    assert main([*argv, "--no-activations"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("GPT2LMHeadModel: ") and "replicate=2,shard=2,tensor=1" in text
    assert "activations: not measured" in text


def test_the_command_line_says_what_is_wrong(gpt2_config: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--hf-config", gpt2_config, "--world-size", "4", "--layouts", "hsdp:3x2"]) == 1
    assert "world size is 4" in capsys.readouterr().err
    assert main(["plan", "--hf-config", "/nonexistent/config.json", "--world-size", "2"]) == 1
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--world-size", "2"])  # neither --hf-config nor --model
    assert exit_.value.code == 2


def test_the_command_line_refuses_a_config_of_negative_or_zero_sizes(
    gpt2_config: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**json.loads(Path(gpt2_config).read_text()), "n_layer": -3, "n_embd": 0}))
    assert main(["plan", "--hf-config", str(config), "--world-size", "2", "--no-activations"]) == 1
    captured = capsys.readouterr()
    assert "n_layer is -3, and a size or count is 0 or more" in captured.err and captured.out == "", captured
    # What such a config builds: no parameters, or one of an empty shape.
    for build, said in [
        (torch.nn.Sequential, "has no parameters"),
        (lambda: torch.nn.ParameterList([torch.nn.Parameter(torch.empty(4, 0))]), r"of shape \[4, 0\]"),
    ]:
        with pytest.raises(faccel.errors.ArgumentValueError, match=said):
            faccel.estimate_memory(build, 2)


def test_the_command_line_builds_a_model_from_a_function_path(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "tests.test_memory_plan:_block", "--world-size", "2", "--optimizer", "sgd"]
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == faccel.estimate_memory(_block, 2, ["ddp", "fsdp"], optimizer="sgd").to_dict()
    assert [row["optimizer"] for row in got["layouts"]] == [row["gradients"] for row in got["layouts"]]
    assert (
        main(["plan", "--model", "tests.test_memory_plan:_block", "--world-size", "2", "--optimizer", "lion"])
        == 1
    )
    assert "optimizer must be one of" in capsys.readouterr().err


def test_pipeline_layouts_hold_their_stage_only() -> None:
    """pp:P: each rank holds its stage's parameters (cut at the split names), a share of the activations."""
    import faccel
    from faccel._report._memory_plan import layout_plan, param_specs, rank_bytes, stage_cuts

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))

    plan = faccel.estimate_memory(
        build, 4, ["fsdp", "pp:2", "pp:4"], inputs=(torch.zeros(8, 64),), split=None
    )
    fsdp, pp2, pp4 = plan.layouts
    assert fsdp.note == "" and "1f1b, 2 micro-batches; stages cut by bytes" in pp2.note
    assert pp2.layout.pipeline == 2 and pp2.layout.shard == 2 and pp4.layout.shard == 1
    # the whole model is held once per replica of each stage: every rank together, shards and stages
    with torch.device("meta"):
        specs = param_specs(build())
    for layout in (pp2.layout, pp4.layout):
        cuts = stage_cuts(specs, layout.pipeline)
        staged = [attrs.evolve(s, stage=c) for s, c in zip(specs, cuts, strict=True)]
        held = sum(rank_bytes(s, layout, r) for s in staged for r in range(layout.world_size))
        assert held == sum(s.nbytes for s in specs)
    assert pp4.parameters == max(  # 4 stages of one Linear each
        sum(s.nbytes for s, c in zip(specs, stage_cuts(specs, 4), strict=True) if c == k) for k in range(4)
    )
    # GPipe holds every micro-batch of its stage, 1F1B at most one per stage of the pipeline
    gpipe = layout_plan(
        specs, pp4.layout, activations=8000, schedule=faccel.Schedule(kind="gpipe", microbatches=8)
    )
    one = layout_plan(
        specs, pp4.layout, activations=8000, schedule=faccel.Schedule(kind="1f1b", microbatches=8)
    )
    assert (gpipe.activations, one.activations) == (2000, 1000)
    named = stage_cuts(specs, 2, ["3"])
    assert named == [0, 0, 0, 0, 0, 0, 1, 1]
