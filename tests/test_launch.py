from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import mpi_envs, not_integers, slurm_envs, torchrun_envs


@given(torchrun_envs())
def test_torchrun_env_gives_its_record(env: dict[str, str]) -> None:
    from faccel import parse_launch

    info = parse_launch(env)
    assert info.launcher == "torchrun"
    assert (info.rank, info.world_size) == (int(env["RANK"]), int(env["WORLD_SIZE"]))
    assert (info.local_rank, info.local_world_size) == (
        int(env["LOCAL_RANK"]),
        int(env["LOCAL_WORLD_SIZE"]),
    )
    assert info.node_rank == int(env["GROUP_RANK"])
    assert (info.master_addr, info.master_port) == (env["MASTER_ADDR"], int(env["MASTER_PORT"]))


@given(slurm_envs())
def test_slurm_env_gives_its_record(env: dict[str, str]) -> None:
    from faccel import parse_launch

    info = parse_launch(env)
    assert info.launcher == "slurm"
    assert (info.rank, info.world_size, info.local_rank, info.node_rank) == (
        int(env["SLURM_PROCID"]),
        int(env["SLURM_NTASKS"]),
        int(env["SLURM_LOCALID"]),
        int(env["SLURM_NODEID"]),
    )
    assert info.local_world_size == int(env["SLURM_NTASKS_PER_NODE"].split("(")[0])
    assert info.master_addr == "gpu07"
    assert info.master_port == 15000 + int(env["SLURM_JOB_ID"]) % 20000


@given(mpi_envs())
def test_mpi_env_gives_its_record(env: dict[str, str]) -> None:
    from faccel import parse_launch

    info = parse_launch(env)
    assert info.launcher == "mpi"
    assert (info.rank, info.world_size) == (
        int(env["OMPI_COMM_WORLD_RANK"]),
        int(env["OMPI_COMM_WORLD_SIZE"]),
    )
    assert info.node_rank == info.rank // info.local_world_size


@given(torchrun_envs(), slurm_envs())
def test_torchrun_inside_a_scheduler_wins(inner: dict[str, str], outer: dict[str, str]) -> None:
    from faccel import parse_launch

    info = parse_launch({**outer, **inner})
    assert (info.launcher, info.rank) == ("torchrun", int(inner["RANK"]))


def test_no_launcher_is_one_process() -> None:
    from faccel import parse_launch

    info = parse_launch({"PATH": "/usr/bin"})
    assert (info.launcher, info.rank, info.world_size, info.master_addr) == ("none", 0, 1, None)


@given(
    st.sampled_from([torchrun_envs(), slurm_envs(), mpi_envs()]).flatmap(lambda s: s),
    st.data(),
    not_integers,
)
def test_non_integer_variables_are_named(env: dict[str, str], data: st.DataObject, bad: str) -> None:
    from faccel import parse_launch
    from faccel.errors import LaunchError

    numeric = [k for k in env if k not in {"MASTER_ADDR", "SLURM_NODELIST", "SLURM_NTASKS_PER_NODE"}]
    key = data.draw(st.sampled_from(sorted(numeric)))
    env = {**env, key: bad}
    with pytest.raises(LaunchError, match=key) as caught:
        parse_launch(env)
    assert repr(bad) in str(caught.value)
    assert isinstance(caught.value, ValueError)


@given(torchrun_envs(), st.integers(min_value=0, max_value=64))
def test_rank_out_of_range_is_named(env: dict[str, str], extra: int) -> None:
    from faccel import parse_launch
    from faccel.errors import LaunchError

    env = {**env, "RANK": str(int(env["WORLD_SIZE"]) + extra)}
    with pytest.raises(LaunchError, match=r"RANK must be in \[0, "):
        parse_launch(env)


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT"])
def test_multi_process_without_rendezvous_is_refused(missing: str) -> None:
    from faccel import parse_launch
    from faccel.errors import LaunchError

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    del env[missing]
    with pytest.raises(LaunchError, match=missing):
        parse_launch(env)


@pytest.mark.parametrize("present", ["RANK", "WORLD_SIZE"])
def test_half_a_torchrun_env_is_refused(present: str) -> None:
    from faccel import parse_launch
    from faccel.errors import LaunchError

    partner = {"RANK": "WORLD_SIZE", "WORLD_SIZE": "RANK"}[present]
    with pytest.raises(LaunchError, match=partner):
        parse_launch({present: "1"})


@given(slurm_envs(), mpi_envs())
def test_disagreeing_schedulers_are_refused(slurm: dict[str, str], mpi: dict[str, str]) -> None:
    from faccel import parse_launch
    from faccel.errors import LaunchError

    agree = (slurm["SLURM_PROCID"], slurm["SLURM_NTASKS"]) == (
        mpi["OMPI_COMM_WORLD_RANK"],
        mpi["OMPI_COMM_WORLD_SIZE"],
    )
    env = {**slurm, **mpi}
    if agree:
        assert parse_launch(env).rank == int(slurm["SLURM_PROCID"])
    else:
        with pytest.raises(LaunchError, match="disagree") as caught:
            parse_launch(env)
        assert "SLURM_" in str(caught.value) and "OMPI_COMM_WORLD_" in str(caught.value)


def test_port_out_of_range_is_named() -> None:
    from faccel import parse_launch
    from faccel.errors import LaunchError

    with pytest.raises(LaunchError, match="MASTER_PORT='70000'"):
        parse_launch({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"})


def test_local_rank_beyond_local_world_is_named() -> None:
    from faccel import parse_launch
    from faccel.errors import LaunchError

    env = {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }
    with pytest.raises(LaunchError, match="LOCAL_RANK"):
        parse_launch(env)
