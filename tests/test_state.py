from __future__ import annotations

import datetime
import re

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import torchrun_envs


@given(torchrun_envs(), st.sampled_from(["no", "bf16", "fp16"]), st.integers(1, 16))
def test_state_from_env_reads_launcher_and_options(env: dict, precision: str, steps: int) -> None:
    from faccel import state_from_env

    s = state_from_env(env, precision=precision, accumulation_steps=steps)
    assert (s.rank, s.world_size, s.local_rank) == (
        int(env["RANK"]),
        int(env["WORLD_SIZE"]),
        int(env["LOCAL_RANK"]),
    )
    assert (s.device, s.backend, s.precision, s.accumulation_steps) == (
        torch.device("cpu"),
        "gloo",
        precision,
        steps,
    )
    assert s.is_main_process == (s.rank == 0)


@given(st.integers(1, 8), st.integers(0, 7))
def test_cuda_device_follows_local_rank(count: int, local: int) -> None:
    from faccel import state_from_env
    from faccel.errors import LaunchError

    env = {
        "RANK": str(local),
        "WORLD_SIZE": "8",
        "LOCAL_RANK": str(local),
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }
    if local < count:
        s = state_from_env(env, cuda_count=count)
        assert (s.device, s.backend) == (torch.device("cuda", local), "nccl")
    else:
        with pytest.raises(LaunchError, match=f"LOCAL_RANK={local}"):
            state_from_env(env, cuda_count=count)


def test_device_preference_and_overrides() -> None:
    from faccel import state_from_env
    from faccel.errors import LaunchError

    assert state_from_env({}, mps_available=True).device == torch.device("mps")
    assert state_from_env({}, cuda_count=2, mps_available=True).device == torch.device("cuda", 0)
    assert state_from_env({}, cuda_count=2, device="cpu").device == torch.device("cpu")
    assert state_from_env({}, cuda_count=2, backend="gloo").backend == "gloo"
    with pytest.raises(LaunchError, match="nccl"):
        state_from_env({}, backend="nccl")


def test_environment_options_and_their_errors() -> None:
    from faccel import state_from_env
    from faccel.errors import LaunchError, PrecisionError

    env = {"FACCEL_PRECISION": "bf16", "FACCEL_ACCUMULATION_STEPS": "4"}
    s = state_from_env(env)
    assert (s.precision, s.accumulation_steps) == ("bf16", 4)
    assert state_from_env(env, precision="no", accumulation_steps=1).precision == "no"
    # From the environment a bad value is the launch's error, naming the variable; as an
    # argument it is the precision's own.
    with pytest.raises(LaunchError, match="FACCEL_PRECISION='fp8'"):
        state_from_env({"FACCEL_PRECISION": "fp8"})
    with pytest.raises(PrecisionError, match="'fp8'"):
        state_from_env({}, precision="fp8")
    with pytest.raises(LaunchError, match="FACCEL_STRATEGY='zero3'"):
        state_from_env({"FACCEL_STRATEGY": "zero3"})
    with pytest.raises(LaunchError, match="FACCEL_ACCUMULATION_STEPS='four'"):
        state_from_env({"FACCEL_ACCUMULATION_STEPS": "four"})
    with pytest.raises(LaunchError, match="accumulation_steps"):
        state_from_env({}, accumulation_steps=0)


def test_the_timeout_ends_a_hung_job_within_minutes_and_is_configurable() -> None:
    from faccel import detect, state_from_env
    from faccel.errors import LaunchError

    # torch's default is 30 minutes; faccel's must end a job with a hung rank within 10.
    assert detect({}).timeout == datetime.timedelta(minutes=5)
    assert state_from_env({"FACCEL_TIMEOUT": "12.5"}).timeout == datetime.timedelta(seconds=12.5)
    assert detect({"FACCEL_TIMEOUT": "60"}, start=False).timeout == datetime.timedelta(minutes=1)
    given = datetime.timedelta(hours=1)
    assert state_from_env({"FACCEL_TIMEOUT": "60"}, timeout=given).timeout == given  # the option wins
    assert state_from_env({"FACCEL_TIMEOUT": "0.5"}).timeout == datetime.timedelta(seconds=0.5)
    # Strict like RANK: ASCII digits with an optional decimal part, nothing else float() takes.
    bad_values = ("soon", "0", "-5", "nan", "inf", "1e300", "", "1_0", "1e-6", "\u0661\u0660", "\uff11\uff10")
    for bad in (*bad_values, " 10", "+10", "10.", ".5", "0.0000001", "99999999999"):
        expected = f"FACCEL_TIMEOUT must be a positive number of seconds, got FACCEL_TIMEOUT={bad!r}"
        with pytest.raises(LaunchError, match=re.escape(expected)):
            state_from_env({"FACCEL_TIMEOUT": bad})


def test_two_states_live_side_by_side() -> None:
    from faccel import detect

    full = detect({}, precision="no", accumulation_steps=1)
    mixed = detect({}, precision="bf16", accumulation_steps=4, seed=7)
    assert (full.precision, full.accumulation_steps, full.seed) == ("no", 1, 0)
    assert (mixed.precision, mixed.accumulation_steps, mixed.seed) == ("bf16", 4, 7)
    assert full != mixed
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        full.precision = "fp16"  # type: ignore[misc]
    changed = attrs.evolve(full, timeout=datetime.timedelta(seconds=5))
    assert changed.timeout.total_seconds() == 5 and full.timeout.total_seconds() == 300


@given(st.integers(1, 1024), st.data())
def test_simulated_state_has_no_peers(world: int, data: st.DataObject) -> None:
    from faccel import DistState

    rank = data.draw(st.integers(0, world - 1))
    s = DistState.simulated(rank=rank, world_size=world)
    assert (s.rank, s.world_size, s.launcher, s.distributed) == (rank, world, "simulated", False)


def test_invalid_records_are_refused() -> None:
    from faccel import DistState
    from faccel.errors import LaunchError, PrecisionError

    with pytest.raises(LaunchError, match=r"rank must be in \[0, 2\)"):
        DistState(rank=2, world_size=2, local_world_size=2)
    with pytest.raises(PrecisionError):
        DistState(precision="half")


def test_detect_in_one_process_starts_nothing() -> None:
    import torch.distributed as tdist

    from faccel import detect, shutdown

    s = detect({})
    assert not s.distributed and not tdist.is_initialized()
    shutdown(s)


def test_detect_validates_its_options_at_runtime() -> None:
    from faccel import detect

    with pytest.raises(TypeError):
        detect({}, seed="zero")  # type: ignore[arg-type]
