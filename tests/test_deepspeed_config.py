"""DeepSpeed configs as Accelerate users run them: the pure parts, no engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import faccel
from faccel._loop._strategies._deepspeed._config import fill_config

DIST = faccel.DistState.simulated(world_size=2, accumulation_steps=2)


def _fill(config: dict, **kwargs: object) -> dict:
    return fill_config(json.dumps(config), dist=DIST, micro_batch_size=4, **kwargs)  # type: ignore[arg-type]


def test_auto_gradient_clipping_is_one_as_accelerate_and_the_trainer_read_it() -> None:
    assert _fill({"gradient_clipping": "auto"})["gradient_clipping"] == 1.0
    assert _fill({})["gradient_clipping"] == 0.0  # left out: faccel clips nothing unasked (documented)
    assert _fill({"gradient_clipping": 0.5})["gradient_clipping"] == 0.5


def test_hidden_size_buckets_at_auto_come_from_the_model_as_in_accelerate() -> None:
    zero = {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    }
    filled = _fill({"zero_optimization": zero}, hidden_size=64)["zero_optimization"]
    assert (filled["reduce_bucket_size"], filled["stage3_prefetch_bucket_size"]) == (4096, 3686)
    assert filled["stage3_param_persistence_threshold"] == 640
    with pytest.raises(faccel.errors.DeepSpeedConfigError, match=r"config\.hidden_size"):
        _fill({"zero_optimization": zero})


def test_an_auto_faccel_does_not_fill_is_refused_by_name() -> None:
    config = {"zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}}
    with pytest.raises(faccel.errors.DeepSpeedConfigError, match=r"zero_optimization\.allgather_bucket_size"):
        _fill(config)


def test_the_auto_values_accelerate_fills_are_filled() -> None:
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2},
    }
    filled = _fill(config)
    assert (filled["train_micro_batch_size_per_gpu"], filled["train_batch_size"]) == (4, 16)
    assert (filled["gradient_accumulation_steps"], filled["gradient_clipping"]) == (2, 1.0)
    assert filled["fp16"]["enabled"] is False and filled["bf16"]["enabled"] is False


def test_a_config_file_from_the_launchers_environment(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"}))
    dist = faccel.detect({"FACCEL_DEEPSPEED_CONFIG": str(path)})
    assert (
        dist.strategy == "deepspeed" and json.loads(dist.deepspeed or "{}")["zero_optimization"]["stage"] == 2
    )
    same = faccel.detect({"FACCEL_DEEPSPEED_CONFIG": str(path), "FACCEL_STRATEGY": "deepspeed"})
    assert same.deepspeed == dist.deepspeed
    with pytest.raises(faccel.errors.LaunchError, match="strategy='ddp' with deepspeed config given"):
        faccel.detect({"FACCEL_DEEPSPEED_CONFIG": str(path), "FACCEL_STRATEGY": "ddp"})
    with pytest.raises(faccel.errors.DeepSpeedConfigError, match="readable JSON file"):
        faccel.detect({"FACCEL_DEEPSPEED_CONFIG": str(tmp_path / "missing.json")})
    mine = faccel.detect(
        {"FACCEL_DEEPSPEED_CONFIG": str(path)}, deepspeed={"zero_optimization": {"stage": 1}}
    )
    assert json.loads(mine.deepspeed or "{}")["zero_optimization"]["stage"] == 1  # the option wins


# The config's optimizer and scheduler sections (Accelerate's DummyOptim / DummyScheduler path).
_SECTIONS = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
}


def test_the_sections_autos_are_filled_from_config_optimizer_and_config_scheduler() -> None:
    filled = _fill(
        _SECTIONS,
        optimizer=faccel.ConfigOptimizer(lr=0.01, weight_decay=0.1),
        scheduler=faccel.ConfigScheduler(warmup_num_steps=3, total_num_steps=12),
    )
    assert filled["optimizer"]["params"] == {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}
    assert filled["scheduler"]["params"] == {
        "warmup_min_lr": 0,  # Accelerate's rule
        "warmup_max_lr": 0.01,  # the optimizer's lr
        "warmup_num_steps": 3,
        "total_num_steps": 12,
    }
    assert json.loads(json.dumps(_SECTIONS))["optimizer"]["params"]["lr"] == "auto"  # the input untouched


def test_a_section_and_what_prepare_was_given_must_agree() -> None:
    DSErr = faccel.errors.DeepSpeedConfigError
    only_optimizer = {"optimizer": _SECTIONS["optimizer"]}
    torch_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(DSErr, match=r"'optimizer' section.*given a SGD; pass faccel\.ConfigOptimizer"):
        _fill(only_optimizer, optimizer=torch_optimizer)
    with pytest.raises(DSErr, match=r"'optimizer' section.*given none"):
        _fill(only_optimizer)
    with pytest.raises(DSErr, match=r"ConfigOptimizer\(\), but the deepspeed config has no 'optimizer'"):
        _fill({}, optimizer=faccel.ConfigOptimizer())
    with pytest.raises(DSErr, match=r"ConfigScheduler\(\), but the deepspeed config has no 'scheduler'"):
        _fill({}, scheduler=faccel.ConfigScheduler())
    with pytest.raises(DSErr, match=r"'scheduler' section.*given none"):
        _fill(_SECTIONS, optimizer=faccel.ConfigOptimizer(lr=0.01, weight_decay=0.0))
    stated = {"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}
    with pytest.raises(DSErr, match=r"optimizer\.params\.lr=0\.001 but ConfigOptimizer\(lr=\) gives 0\.01"):
        _fill(stated, optimizer=faccel.ConfigOptimizer(lr=0.01))
    assert _fill(stated, optimizer=faccel.ConfigOptimizer())["optimizer"]["params"]["lr"] == 0.001
    with pytest.raises(DSErr, match=r"optimizer\.params\.lr, optimizer\.params\.weight_decay at 'auto'"):
        _fill(only_optimizer, optimizer=faccel.ConfigOptimizer())  # no lr to fill it from: named
    with pytest.raises(DSErr, match="a 'type' string and a 'params' object"):
        _fill({"optimizer": {"params": {}}}, optimizer=faccel.ConfigOptimizer())


@pytest.mark.parametrize(("kind", "op"), [("Lamb", "FusedLamb"), ("lion", "FusedLion")])
def test_an_optimizer_without_a_cpu_kernel_is_refused_by_name_on_cpu(kind: str, op: str) -> None:
    config = {"optimizer": {"type": kind, "params": {"lr": 0.01}}}
    with pytest.raises(
        faccel.errors.DeepSpeedConfigError, match=rf"DeepSpeed's {op}, whose op has no CPU kernel"
    ):
        _fill(config, optimizer=faccel.ConfigOptimizer())


def test_config_optimizer_and_scheduler_outside_deepspeed_are_refused_at_prepare() -> None:
    dist = faccel.detect({})
    with pytest.raises(faccel.errors.PrepareError, match=r"ConfigOptimizer stands for.*strategy is 'ddp'"):
        faccel.prepare(dist, torch.nn.Linear(2, 1), faccel.ConfigOptimizer(lr=0.1))
    with pytest.raises(faccel.errors.PrepareError, match="ConfigScheduler stands for"):
        faccel.prepare(dist, faccel.ConfigScheduler(total_num_steps=3))
