"""Accelerate's helpers in one process: find_executable_batch_size, comm hooks (issue 36, items 3 and 5)."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd", "batched_powersgd"])
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
