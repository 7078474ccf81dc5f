"""Accelerate's helpers in one process: find_executable_batch_size, comm hooks (issue 36, items 3 and 5)."""

from __future__ import annotations

import pytest
import torch
from typeguard import TypeCheckError

import faccel


def test_find_executable_batch_size_shrinks_by_accelerates_rule_on_torchs_oom_error() -> None:
    tried = []

    @faccel.find_executable_batch_size(faccel.detect({}), starting_batch_size=128)
    def train(batch_size: int, scale: int) -> int:
        tried.append(batch_size)
        if batch_size > 50:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return batch_size * scale

    assert train(2) == 92
    assert tried == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46]
    tried.clear()
    assert train(scale=1) == 46 and tried[0] == 128  # each call starts again: nothing remembered


def test_find_executable_batch_size_takes_the_cpu_allocators_message_and_passes_other_errors() -> None:
    dist = faccel.detect({})
    calls = []

    def cpu_oom(batch_size: int) -> int:
        calls.append(batch_size)
        if batch_size > 2:
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
            )
        return batch_size

    assert faccel.find_executable_batch_size(dist, cpu_oom, starting_batch_size=4, shrink=0.5)() == 2

    @faccel.find_executable_batch_size(dist, starting_batch_size=8)
    def broken(batch_size: int) -> int:
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken()


def test_find_executable_batch_size_names_every_size_tried_when_none_fits() -> None:
    @faccel.find_executable_batch_size(faccel.detect({}), starting_batch_size=3)
    def train(batch_size: int) -> None:
        raise torch.OutOfMemoryError("out of memory.")

    with pytest.raises(faccel.errors.BatchSizeError, match=r"every size tried \(3, 2, 1\)"):
        train()


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"starting_batch_size": 0}, "starting"), ({"shrink": 1.0}, "shrink")]
)
def test_find_executable_batch_size_refuses_bad_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(faccel.errors.ArgumentValueError, match=match):
        faccel.find_executable_batch_size(faccel.detect({}), **kwargs)


# batched_powersgd: refused where torch's hook cannot run (test_batched_powersgd_is_refused_by_name...)
@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_a_comm_hook_in_one_process_is_accepted_and_changes_nothing(hook: str) -> None:
    torch.manual_seed(0)
    model = faccel.prepare(faccel.detect({}), torch.nn.Linear(2, 2), comm_hook=hook)
    assert isinstance(model, torch.nn.Linear)


def test_comm_hook_mistakes_are_refused_by_name() -> None:
    dist = faccel.detect({})
    with pytest.raises(faccel.errors.ArgumentValueError, match="comm_hook must be one of"):
        faccel.prepare(dist, torch.nn.Linear(2, 2), comm_hook="fp8")
    with pytest.raises(faccel.errors.ArgumentValueError, match="do not apply"):
        faccel.prepare(dist, torch.nn.Linear(2, 2), comm_hook="fp16", comm_hook_options={"warm_start": False})
    with pytest.raises(faccel.errors.PrepareError, match="DistributedDataParallel hook"):
        faccel.prepare(faccel.detect({}, strategy="fsdp"), torch.nn.Linear(2, 2), comm_hook="fp16")


def test_the_bf16_hook_is_refused_by_name_on_gloo() -> None:
    from faccel._loop._strategies._ddp._comm_hooks import check_comm_hook

    two = faccel.DistState.simulated(rank=0, world_size=2)
    with pytest.raises(faccel.errors.PrepareError, match="needs NCCL"):
        check_comm_hook(two, "bf16", None)
    with pytest.raises(faccel.errors.PrepareError, match="needs NCCL"):
        check_comm_hook(two, "powersgd", {"wrapper": "bf16"})


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"matrix_approximation_rank": 0}, "matrix_approximation_rank'] must be an int >= 1, got 0"),
        ({"matrix_approximation_rank": -1}, "matrix_approximation_rank'] must be an int >= 1, got -1"),
        ({"orthogonalization_epsilon": float("nan")}, "orthogonalization_epsilon'] must be a finite number"),
        ({"random_seed": -1}, r"random_seed'] must be an int from 0 to 2\*\*32 - 1, got -1"),
        ({"start_powerSGD_iter": 1}, "start_powerSGD_iter'] is 1, and with use_error_feedback"),
        ({"use_error_feedback": "yes"}, "use_error_feedback'] must be True or False"),
        ({"min_compression_rate": 0}, "min_compression_rate'] must be a finite number > 0"),
    ],
)
def test_powersgd_options_that_would_freeze_poison_or_crash_are_refused_by_name(
    options: dict, match: str
) -> None:
    with pytest.raises(faccel.errors.ArgumentValueError, match=match):
        faccel.prepare(
            faccel.detect({}), torch.nn.Linear(2, 2), comm_hook="powersgd", comm_hook_options=options
        )


def test_powersgd_starting_at_step_one_without_state_is_accepted() -> None:
    options = {"start_powerSGD_iter": 1, "use_error_feedback": False, "warm_start": False}
    faccel.prepare(faccel.detect({}), torch.nn.Linear(2, 2), comm_hook="powersgd", comm_hook_options=options)


def test_batched_powersgd_is_refused_by_name_where_torchs_hook_cannot_run() -> None:
    from faccel._torch_compat import batched_powersgd_works

    if batched_powersgd_works():
        pytest.skip("this torch's batched PowerSGD hook runs")
    with pytest.raises(faccel.errors.PrepareError, match="use comm_hook='powersgd'"):
        faccel.prepare(faccel.detect({}), torch.nn.Linear(2, 2), comm_hook="batched_powersgd")


def test_local_sgd_and_profile_arguments_of_another_type_or_range_are_named() -> None:
    dist = faccel.detect({})
    model = torch.nn.Linear(2, 1)
    errors = faccel.errors
    with pytest.raises(errors.ArgumentError, match="every"), faccel.local_sgd(dist, model, every=2.5):
        pass
    with faccel.local_sgd(dist, model, every=2) as local:
        # (the suite's own type checker may name it first: tests/test_mistakes.py runs it without)
        with pytest.raises((errors.ArgumentError, TypeCheckError), match=r"local.step\(n\) takes n|step"):
            local.step("3")  # type: ignore[arg-type]
        with pytest.raises(errors.ArgumentValueError, match=r"an int >= 1\), got 0"):
            local.step(0)
    with pytest.raises(errors.ArgumentError, match="schedule"), faccel.profile(dist, schedule={"wait": "1"}):  # type: ignore[dict-item]
        pass
    for schedule, match in [
        ({"wait": -1}, "wait is a number of steps, an int >= 0"),
        ({"active": 0}, "records nothing"),
    ]:
        with pytest.raises(errors.ArgumentValueError, match=match), faccel.profile(dist, schedule=schedule):
            pass


def test_profile_refuses_a_trace_dir_that_cannot_be_a_folder(tmp_path) -> None:
    dist = faccel.detect({})
    file = tmp_path / "file"
    file.write_text("x")
    for trace_dir, match in [
        (file, "is a file"),
        (file / "under", "under a file"),
        (str(tmp_path) + "/a\x00b", "NUL"),
    ]:
        with pytest.raises(faccel.errors.ArgumentValueError, match=match), faccel.profile(dist, trace_dir):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing made


def test_find_executable_batch_size_refuses_a_batch_size_passed_by_keyword() -> None:
    @faccel.find_executable_batch_size(faccel.detect({}), starting_batch_size=4)
    def train(batch_size: int) -> int:
        return batch_size

    with pytest.raises(
        faccel.errors.ArgumentError, match=r"train\(batch_size=8\): find_executable_batch_size passes"
    ):
        train(batch_size=8)
