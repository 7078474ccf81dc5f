"""``python -m faccel env``: what faccel sees on this machine, for bug reports.

:func:`env_report` is pure: the environment, the package versions and the
hardware facts are its arguments, so it can be tested for any launcher and
any machine. :func:`collect_versions` and :func:`collect_hardware` are the
edge that reads the real ones. Nothing here starts a process group.

The variables it lists are ``faccel._dist._launch.ENV_VARIABLES``, the table that
``parse_launch`` and ``state_from_env`` read by, so the report cannot drift
from what ``detect()`` reads.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

import attrs

from faccel._dist._launch import ENV_VARIABLES, LAUNCHERS, OPTION_VARIABLES
from faccel._dist._state import DistState, state_from_env
from faccel._tree import to_plain
from faccel.errors import FaccelError

__all__ = [
    "EnvReport",
    "Hardware",
    "collect_hardware",
    "collect_versions",
    "env_report",
    "render_text",
    "report_dict",
]

PACKAGES = ("torch", "faccel", "attrs", "safetensors", "numpy", "typeguard", "tqdm")
BACKENDS = ("gloo", "nccl", "mpi")


@attrs.frozen(kw_only=True)
class Hardware:
    """What this machine and this build of torch offer.

    Attributes:
        cuda_names: Names of the visible CUDA devices (empty: none).
        mps_available: Whether Apple's MPS device can be used.
        backends: ``torch.distributed`` backend name -> available in this build.
        platform: Operating system and architecture.
        cpu_count: Logical CPUs.
        torch_cuda: The CUDA version torch was built with, or None (a CPU build).

    Example:
        >>> Hardware(cuda_names=("H100",), backends={"nccl": True}).cuda_count
        1
    """

    cuda_names: tuple[str, ...] = ()
    mps_available: bool = False
    backends: Mapping[str, bool] = attrs.field(factory=dict)
    platform: str = ""
    cpu_count: int = 1
    torch_cuda: str | None = None

    @property
    def cuda_count(self) -> int:
        """Number of visible CUDA devices."""
        return len(self.cuda_names)


@attrs.frozen(kw_only=True)
class EnvReport:
    """What ``detect()`` would see in a process started with this environment, and why.

    Attributes:
        versions: Package -> version (None: not installed).
        hardware: The machine's devices and backends.
        variables: Who sets it (``torchrun``, ``slurm``, ``mpi``, ``rendezvous``,
            ``faccel``) -> the variables of that group found, with their values.
        launcher: The launcher ``detect()`` would credit, or None when the
            environment is malformed.
        state: The fields of the ``DistState`` that ``detect()`` would return,
            as plain values, or None when it would raise.
        problems: What would make ``detect()`` fail or the run misbehave, with the fix.
        notes: Facts worth knowing that are not problems.

    Example:
        >>> report = env_report({}, versions={"torch": "2.13.0"}, hardware=Hardware())
        >>> (report.launcher, report.state["world_size"], report.problems)
        ('none', 1, ())
    """

    versions: Mapping[str, str | None]
    hardware: Hardware
    variables: Mapping[str, Mapping[str, str]]
    launcher: str | None
    state: Mapping[str, Any] | None
    problems: tuple[str, ...]
    notes: tuple[str, ...]


def _state_fields(state: DistState) -> dict[str, Any]:
    return {
        "launcher": state.launcher,
        "rank": state.rank,
        "world_size": state.world_size,
        "local_rank": state.local_rank,
        "local_world_size": state.local_world_size,
        "node_rank": state.node_rank,
        "device": str(state.device),
        "backend": state.backend,
        "precision": state.precision,
        "accumulation_steps": state.accumulation_steps,
        "strategy": state.strategy,
        "layout": str(state.parallel),
        "timeout_seconds": state.timeout.total_seconds(),
        "master_addr": state.master_addr,
        "master_port": state.master_port,
        "external_store": state.external_store,
        "distributed": state.distributed,
    }


def _launcher_notes(found: Mapping[str, Mapping[str, str]], launcher: str | None) -> list[str]:
    present = [name for name in LAUNCHERS if found[name]]
    notes = []
    if launcher is not None and len(present) > 1:
        others = ", ".join(name for name in present if name != launcher)
        notes.append(f"variables of {others} are also set; {launcher}'s win (the innermost launcher)")
    if launcher == "none":
        notes.append("no launcher variables found: one process, as under plain `python`")
    return notes


def _backend_problems(state: DistState, hardware: Hardware) -> list[str]:
    if not state.distributed or hardware.backends.get(state.backend, True):
        return []
    available = [name for name in BACKENDS if hardware.backends.get(name)]
    return [
        f"WORLD_SIZE is {state.world_size} and the backend would be {state.backend!r}, "
        f"which this build of torch lacks (available: {available or 'none'}); "
        "install a torch build with it, or pass backend= to faccel.detect()"
    ]


def env_report(
    env: Mapping[str, str], *, versions: Mapping[str, str | None], hardware: Hardware
) -> EnvReport:
    """The report for a process started with ``env`` on ``hardware``. Pure; never raises.

    ``detect()`` is asked through :func:`faccel.state_from_env` with the same
    hardware facts it reads itself; an error it would raise becomes a problem.

    Args:
        env: The environment (``os.environ`` on the command line).
        versions: Package -> installed version.
        hardware: The machine's devices and backends.

    Returns:
        The :class:`EnvReport`.

    Example:
        >>> report = env_report({"WORLD_SIZE": "2", "RANK": "0"}, versions={}, hardware=Hardware())
        >>> report.state is None, report.variables["torchrun"]
        (True, {'RANK': '0', 'WORLD_SIZE': '2'})
        >>> print(report.problems[0])
        LaunchError: WORLD_SIZE is 2 (from torchrun) but MASTER_ADDR is not set; ...
    """
    found = {
        group: {name: env[name] for name in names if name in env} for group, names in ENV_VARIABLES.items()
    }
    # The launcher's variables and faccel's own options are checked apart, so a
    # bad FACCEL_PRECISION does not hide a missing MASTER_ADDR, or the reverse.
    options = set(OPTION_VARIABLES.values())
    launch, launch_problem = _attempt({k: v for k, v in env.items() if k not in options}, hardware)
    _, option_problem = _attempt({k: v for k, v in env.items() if k in options}, hardware)
    problems = [p for p in (launch_problem, option_problem) if p is not None]
    state = None
    if not problems:
        state, problem = _attempt(env, hardware)
        if problem is not None:
            problems.append(problem)
        elif state is not None:
            problems.extend(_backend_problems(state, hardware))
    launcher = launch.launcher if launch is not None else None
    notes = _launcher_notes(found, launcher)
    if state is not None and state.distributed:
        notes.append(
            f"detect() would start a {state.backend} process group at {state.master_addr}:"
            f"{state.master_port} (this report starts none)"
        )
    return EnvReport(
        versions=dict(versions),
        hardware=hardware,
        variables=found,
        launcher=launcher,
        state=_state_fields(state) if state is not None else None,
        problems=tuple(problems),
        notes=tuple(notes),
    )


def _attempt(env: Mapping[str, str], hardware: Hardware) -> tuple[DistState | None, str | None]:
    """(the state ``detect()`` would build, None), or (None, the error it would raise)."""
    try:
        state = state_from_env(env, cuda_count=hardware.cuda_count, mps_available=hardware.mps_available)
    except FaccelError as error:
        return None, f"{type(error).__name__}: {error}"
    return state, None


def report_dict(report: EnvReport) -> dict[str, Any]:
    """The report as plain JSON-able data (``--json``).

    Example:
        >>> import json
        >>> data = report_dict(env_report({}, versions={"torch": "2.13.0"}, hardware=Hardware()))
        >>> json.loads(json.dumps(data)) == data, data["state"]["device"]
        (True, 'cpu')
    """
    data: dict[str, Any] = to_plain(attrs.asdict(report))
    data["hardware"]["cuda_count"] = report.hardware.cuda_count
    return data


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def render_text(report: EnvReport) -> str:
    """The report as text for a terminal (the default of ``python -m faccel env``).

    Example:
        >>> text = render_text(env_report({}, versions={"torch": "2.13.0"}, hardware=Hardware()))
        >>> print(text.split("\\n\\n")[-1])
        Problems
          none found
    """
    hw = report.hardware
    lines = ["faccel environment report", "", "Versions"]
    lines += [f"  {name:<12} {version or 'not installed'}" for name, version in report.versions.items()]
    lines += [
        "",
        "Machine",
        f"  {'platform':<12} {hw.platform or 'unknown'}, {hw.cpu_count} CPU(s)",
        f"  {'torch CUDA':<12} {hw.torch_cuda or 'none (CPU build)'}",
        f"  {'CUDA':<12} {hw.cuda_count} device(s)"
        + (f": {', '.join(hw.cuda_names)}" if hw.cuda_names else ""),
        f"  {'MPS':<12} {_yes(hw.mps_available)}",
        f"  {'backends':<12} " + ", ".join(f"{b} {_yes(hw.backends.get(b, False))}" for b in BACKENDS),
        "",
        "Environment variables faccel reads",
    ]
    found = [
        (group, name, value) for group, names in report.variables.items() for name, value in names.items()
    ]
    lines += [f"  {name}={value}  ({group})" for group, name, value in found] or ["  none set"]
    lines += ["", "What detect() would give"]
    if report.state is None:
        lines.append("  an error (see Problems)")
    else:
        lines += [f"  {key:<18} {value}" for key, value in report.state.items()]
    if report.notes:
        lines += ["", "Notes", *(f"  {note}" for note in report.notes)]
    lines += ["", "Problems", *(f"  {problem}" for problem in report.problems or ("none found",))]
    return "\n".join(lines)


def collect_versions() -> dict[str, str | None]:
    """Installed versions of Python and faccel's dependencies (read from package metadata).

    Example:
        >>> collect_versions()["python"] == ".".join(map(str, __import__("sys").version_info[:3]))
        True
    """
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    if versions["faccel"] is None:  # run from a source tree that was not installed
        versions["faccel"] = sys.modules["faccel"].__version__
    return versions


def collect_hardware() -> Hardware:
    """This machine's devices and this torch build's backends, as ``detect()`` reads them.

    Example:
        >>> sorted(collect_hardware().backends)
        ['gloo', 'mpi', 'nccl']
    """
    import torch
    import torch.distributed as tdist

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    checks = {
        "gloo": tdist.is_gloo_available,
        "nccl": tdist.is_nccl_available,
        "mpi": tdist.is_mpi_available,
    }
    return Hardware(
        cuda_names=tuple(torch.cuda.get_device_name(i) for i in range(cuda)),
        mps_available=torch.backends.mps.is_available(),
        backends={name: tdist.is_available() and check() for name, check in checks.items()},
        platform=platform.platform(),
        cpu_count=os.cpu_count() or 1,
        torch_cuda=torch.version.cuda,
    )
