from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import launcher_envs, mpi_envs, not_integers, slurm_envs, torchrun_envs


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

    env = {**slurm, **mpi}
    # Both claim to have started this process: where they place it must agree in full.
    slurm_info = parse_launch(slurm)
    mpi_info = parse_launch(mpi)
    fields = ("rank", "world_size", "local_rank", "local_world_size")
    agree = all(getattr(slurm_info, f) == getattr(mpi_info, f) for f in fields)
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


@given(launcher_envs())
def test_any_environment_gives_a_valid_state_or_a_launch_error(env: dict[str, str]) -> None:
    from faccel import state_from_env
    from faccel.errors import LaunchError

    try:
        s = state_from_env(env)
    except LaunchError:
        return
    assert 0 <= s.rank < s.world_size <= 2**31 - 1
    assert 0 <= s.local_rank < s.local_world_size <= s.world_size
    assert s.node_rank == s.rank // s.local_world_size
    digits = {
        k: v for k, v in env.items() if k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
    }
    assert all(v.isascii() and v.isdigit() for v in digits.values())


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK='1'"),
        ({"GROUP_RANK": "1"}, "GROUP_RANK='1'"),
        ({"SLURM_LOCALID": "1"}, "SLURM_LOCALID='1'"),
        ({"RANK": "0_1", "WORLD_SIZE": "2"}, "RANK='0_1'"),
        ({"RANK": "0", "WORLD_SIZE": "1_0"}, "WORLD_SIZE='1_0'"),
        ({"RANK": "+1", "WORLD_SIZE": "2"}, "RANK='+1'"),
        ({"RANK": "0", "WORLD_SIZE": "\uff12"}, "WORLD_SIZE='\uff12'"),
        ({"RANK": "\u0660", "WORLD_SIZE": "2"}, "RANK='\u0660'"),
        ({"RANK": "0", "WORLD_SIZE": str(2**70)}, "WORLD_SIZE="),
        (
            {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"},
            "GROUP_RANK='0'",
        ),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "[", "SLURM_JOB_ID": "7"},
            "SLURM_NODELIST='['",
        ),
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": "0",
                "OMPI_COMM_WORLD_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
            },
            "disagree",
        ),
    ],
)
def test_partial_malformed_and_conflicting_environments_are_named(env: dict[str, str], named: str) -> None:
    # Each was accepted before: silently one process, or a different number than written.
    from faccel import state_from_env
    from faccel.errors import LaunchError

    with pytest.raises(LaunchError) as caught:
        state_from_env(env)
    assert named in str(caught.value)
