"""`python -m faccel env`: the pure report over any environment, and the command line."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import ItemsView, Iterator, Mapping
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import mpi_envs, not_integers, slurm_envs, torchrun_envs

ROOT = Path(__file__).resolve().parents[1]
_NAMES = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "FACCEL_PRECISION",
    "FACCEL_ACCUMULATION_STEPS",
    "FACCEL_STRATEGY",
    "PATH",
    "HOME",
]
_values = st.one_of(
    st.integers(-2, 9).map(str),
    not_integers,
    st.sampled_from(["no", "bf16", "fp16", "fp8", "ddp", "fsdp", "zero"]),
)
# Valid launches, valid launches with a few variables overwritten or removed, and noise.
envs = st.one_of(
    torchrun_envs(),
    slurm_envs(),
    mpi_envs(),
    st.builds(lambda a, b: {**a, **b}, torchrun_envs(), st.dictionaries(st.sampled_from(_NAMES), _values)),
    st.builds(lambda a, b: {**a, **b}, slurm_envs(), st.dictionaries(st.sampled_from(_NAMES), _values)),
    st.builds(
        lambda e, drop: {k: v for k, v in e.items() if k not in drop},
        torchrun_envs(),
        st.sets(st.sampled_from(_NAMES)),
    ),
    st.dictionaries(st.sampled_from(_NAMES), _values),
)


@st.composite
def hardware(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    from faccel._dist._env_report import Hardware

    return Hardware(
        cuda_names=tuple(draw(st.lists(st.sampled_from(["H100", "A100", "T4"]), max_size=4))),
        mps_available=draw(st.booleans()),
        backends={name: draw(st.booleans()) for name in ("gloo", "nccl", "mpi")},
        platform="Linux-x86_64",
        cpu_count=draw(st.integers(1, 256)),
    )


@given(envs, hardware())
def test_the_report_is_what_detect_would_see(env: dict[str, str], hw) -> None:  # type: ignore[no-untyped-def]
    from faccel import state_from_env
    from faccel._dist._env_report import env_report
    from faccel._dist._launch import ENV_VARIABLES
    from faccel.errors import FaccelError

    report = env_report(env, versions={"torch": "2.13.0"}, hardware=hw)
    # Every variable faccel reads is listed, with its value, and nothing else.
    listed = {name: value for group in report.variables.values() for name, value in group.items()}
    assert listed == {k: v for k, v in env.items() if any(k in names for names in ENV_VARIABLES.values())}
    try:
        state = state_from_env(env, cuda_count=hw.cuda_count, mps_available=hw.mps_available)
    except FaccelError as error:
        # detect() would raise: the report has no state and shows the error verbatim.
        assert report.state is None
        assert f"{type(error).__name__}: {error}" in report.problems
    else:
        assert report.state is not None
        assert (report.launcher, report.state["rank"], report.state["world_size"]) == (
            state.launcher,
            state.rank,
            state.world_size,
        )
        assert (report.state["device"], report.state["backend"]) == (str(state.device), state.backend)
        assert (report.state["precision"], report.state["accumulation_steps"], report.state["strategy"]) == (
            state.precision,
            state.accumulation_steps,
            state.strategy,
        )
        usable = not state.distributed or hw.backends[state.backend]
        assert (report.problems == ()) == usable


@given(envs, hardware())
def test_both_renderings_carry_every_problem(env: dict[str, str], hw) -> None:  # type: ignore[no-untyped-def]
    from faccel._dist._env_report import env_report, render_text, report_dict

    report = env_report(env, versions={"torch": "2.13.0", "numpy": None}, hardware=hw)
    data = report_dict(report)
    assert json.loads(json.dumps(data)) == data
    assert data["problems"] == list(report.problems)
    assert data["hardware"]["cuda_count"] == len(hw.cuda_names)
    text = render_text(report)
    assert all(problem in text for problem in report.problems)
    assert "numpy        not installed" in text
    assert ("none found" in text) == (not report.problems)


def test_independent_problems_are_all_reported() -> None:
    from faccel._dist._env_report import Hardware, env_report

    report = env_report(
        {"WORLD_SIZE": "2", "RANK": "0", "FACCEL_PRECISION": "fp8"}, versions={}, hardware=Hardware()
    )
    # An option from the environment is refused as the launch's error, naming the variable.
    assert [p.split(":")[0] for p in report.problems] == ["LaunchError", "LaunchError"]
    assert "MASTER_ADDR is not set" in report.problems[0]
    assert "got FACCEL_PRECISION='fp8'" in report.problems[1]


def test_a_missing_backend_and_a_second_launcher_are_explained() -> None:
    from faccel._dist._env_report import Hardware, env_report

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    env |= {"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}
    report = env_report(env, versions={}, hardware=Hardware(cuda_names=("H100",), backends={"nccl": False}))
    assert report.state is not None and report.state["backend"] == "nccl"
    (problem,) = report.problems
    assert "'nccl', which this build of torch lacks" in problem
    assert any("slurm are also set; torchrun's win" in note for note in report.notes)
    assert any("would start a nccl process group at h:29500" in note for note in report.notes)


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "SLURM_", "OMPI_"))
    }
    return subprocess.run(
        [sys.executable, "-m", "faccel", "env", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
        cwd=ROOT,
        check=False,
    )


def test_cli_text_shows_versions_devices_and_the_problem() -> None:
    done = _cli(WORLD_SIZE="2", RANK="0")
    # A report with a problem exits 1 (it exited 0 before: a script could not tell).
    assert done.returncode == 1, done.stderr
    out = done.stdout
    assert out.startswith("faccel environment report")
    import torch

    assert f"torch        {torch.__version__}" in out
    assert "backends     gloo yes" in out
    assert "RANK=0  (torchrun)" in out
    assert "LaunchError: WORLD_SIZE is 2 (from torchrun) but MASTER_ADDR is not set" in out


def test_cli_json_is_the_report_of_this_machine() -> None:
    done = _cli("--json", FACCEL_PRECISION="bf16")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    import torch

    assert data["versions"]["torch"] == torch.__version__
    assert data["versions"]["faccel"] == "0.1.0"
    assert data["hardware"]["backends"]["gloo"] is True
    assert data["state"]["precision"] == "bf16"
    assert data["state"]["timeout_seconds"] == 300.0  # the default: a hung rank ends the job in 5 minutes
    assert data["variables"]["faccel"] == {"FACCEL_PRECISION": "bf16"}
    assert data["problems"] == []


def test_cli_exits_1_when_the_report_lists_a_problem_in_either_rendering() -> None:
    for args in ((), ("--json",)):
        done = _cli(*args, FACCEL_TIMEOUT="soon")
        assert done.returncode == 1, done.stderr
        assert "FACCEL_TIMEOUT must be a positive number of seconds, got FACCEL_TIMEOUT='soon'" in done.stdout


def test_cli_help_is_plain_text() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "faccel", "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0
    assert "``" not in done.stdout
    assert "1 when the report lists a problem" in " ".join(done.stdout.split())


def test_cli_without_a_command_explains_usage() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "faccel"], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )
    assert done.returncode == 2
    assert "usage: python -m faccel" in done.stderr
    assert "{env,convert,consolidate,plot,plan}" in done.stderr


def test_cli_never_starts_a_process_group() -> None:
    # Rank 1 of a rendezvous nobody hosts: detect() would wait there; the report returns at once.
    done = _cli(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="9")
    assert done.returncode == 0, done.stderr
    assert "would start a gloo process group at 127.0.0.1:9" in done.stdout
    assert "MASTER_PORT=9  (rendezvous)" in done.stdout


# --- the one table of variables: everything detect() reads is in it ------------------------------


class _Recording(Mapping[str, str]):
    """An environment that logs every variable looked up (present or not)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = dict(env)
        self.looked_up: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.looked_up.add(key)
        return self._env[key]

    def __contains__(self, key: object) -> bool:
        self.looked_up.add(str(key))
        return key in self._env

    def __iter__(self) -> Iterator[str]:  # walking the whole environment reads every variable
        self.looked_up.add("<every variable: the environment was iterated>")
        return iter(self._env)

    def __len__(self) -> int:
        self.looked_up.add("<every variable: the environment was measured>")
        return len(self._env)

    def items(self) -> ItemsView[str, str]:
        # typeguard (setup_checked, and the suite's --typeguard-packages) samples a
        # Mapping[str, str] argument through items(): a type check, not a variable read.
        if not sys._getframe(1).f_globals.get("__name__", "").startswith("typeguard"):
            self.looked_up.add("<every variable: the environment's items were read>")
        return self._env.items()


def _reads(env: Mapping[str, str]) -> set[str]:
    """The variables parse_launch, state_from_env and detect(start=False) look up in ``env``."""
    from faccel import detect, parse_launch, state_from_env
    from faccel.errors import FaccelError

    read: set[str] = set()
    for call in (
        parse_launch,
        lambda e: state_from_env(e, cuda_count=2, mps_available=True),
        lambda e: detect(e, start=False),
    ):
        recording = _Recording(env)
        # A malformed environment raises: what was read up to the error still counts.
        with contextlib.suppress(FaccelError):
            call(recording)
        read |= recording.looked_up
    return read


def _table() -> set[str]:
    from faccel._dist._launch import ENV_VARIABLES

    return {name for names in ENV_VARIABLES.values() for name in names}


_LISTED = sorted(
    {*_NAMES, "GROUP_RANK", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_NODEID", "SLURM_NODELIST"}
    | {"SLURM_JOB_ID", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"}
    | {"TORCHELASTIC_USE_AGENT_STORE", "CUDA_VISIBLE_DEVICES", "FACCEL_SEED", "USER"}
)
_any_values = st.one_of(_values, st.sampled_from(["True", "False", "node[01-04]", "4(x2)", "2,1"]))


@given(
    st.one_of(
        envs,
        st.dictionaries(st.sampled_from(_LISTED), _any_values),
        st.builds(
            lambda a, b: {**a, **b}, mpi_envs(), st.dictionaries(st.sampled_from(_LISTED), _any_values)
        ),
        st.builds(
            lambda a, b: {**a, **b}, slurm_envs(), st.dictionaries(st.sampled_from(_LISTED), _any_values)
        ),
    )
)
def test_detect_reads_no_variable_outside_the_table(env: dict[str, str]) -> None:
    outside = _reads(env) - _table()
    assert not outside, f"read but not in faccel._dist._launch.ENV_VARIABLES: {sorted(outside)}"


def test_every_variable_of_the_table_is_read_somewhere() -> None:
    # The converse: the table lists nothing that is no longer read (one environment per path).
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2"}
    read = (
        _reads(
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}
        )
        | _reads({**slurm, "SLURM_NODEID": "0", "SLURM_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7"})
        | _reads({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"})
        | _reads({"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"} | slurm)
    )
    assert read == _table()


def test_the_table_is_the_one_the_docs_and_the_report_show() -> None:
    from faccel._dist._env_report import Hardware, env_report

    docs = (ROOT / "docs" / "distributed.md").read_text()
    section = docs.split("## Every environment variable faccel reads")[1].split("\n## ")[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    assert {name for row in rows for name in re.findall(r"`([A-Z_]+)`", row)} == _table()
    every = {name: "1" for name in _table()}
    report = env_report(every, versions={}, hardware=Hardware())
    assert {name for group in report.variables.values() for name in group} == _table()
    assert report.variables["faccel"] == {
        "FACCEL_PRECISION": "1",
        "FACCEL_ACCUMULATION_STEPS": "1",
        "FACCEL_STRATEGY": "1",
        "FACCEL_TIMEOUT": "1",
        "FACCEL_TRAIN_TIMEOUT": "1",
        "FACCEL_LAYOUT": "1",
        "FACCEL_DEEPSPEED_CONFIG": "1",
    }


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_report_shows_the_strategy_from_the_environment(strategy: str) -> None:
    from faccel._dist._env_report import Hardware, env_report

    report = env_report({"FACCEL_STRATEGY": strategy}, versions={}, hardware=Hardware())
    assert report.state is not None and report.state["strategy"] == strategy


def test_a_lenient_timeout_is_a_problem_of_the_report() -> None:
    from faccel._dist._env_report import Hardware, env_report

    for bad in ("1_0", "1e-6", "\u0661\u0660", "\uff11\uff10"):
        report = env_report({"FACCEL_TIMEOUT": bad}, versions={}, hardware=Hardware())
        assert report.problems == (
            f"LaunchError: FACCEL_TIMEOUT must be a positive number of seconds, got FACCEL_TIMEOUT={bad!r}; "
            "write ASCII digits with an optional decimal part (FACCEL_TIMEOUT=30 or 12.5), "
            "or unset it for the default (300 s)",
        )
