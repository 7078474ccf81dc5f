"""Reading a launcher's environment: a pure function from a mapping to a record.

Three launchers are understood, each described by a table row rather than by
branches: torchrun (and anything else that sets ``RANK``/``WORLD_SIZE``),
SLURM's ``srun`` and Open MPI's ``mpirun``. torchrun is always the innermost
launcher (a scheduler starts torchrun, never the reverse), so its variables
win over a scheduler's; SLURM and Open MPI both claim to have started this
very process, so when both are present they must agree.

:data:`ENV_VARIABLES` is the one list of every environment variable faccel
reads, grouped by who sets it: this module's launcher rows, the rendezvous
variables, and faccel's own options (:data:`OPTION_VARIABLES`, read by
``faccel._dist._state.state_from_env``). ``python -m faccel env`` prints what it
lists, and a test proves that ``parse_launch``, ``state_from_env`` and
``detect`` look up no variable outside it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

import attrs

from faccel._choices import Launcher
from faccel.errors import LaunchError

__all__ = [
    "ENV_VARIABLES",
    "LAUNCHERS",
    "MAX_INT",
    "OPTION_VARIABLES",
    "LaunchInfo",
    "parse_launch",
    "rank_and_world",
    "read_int",
]


@attrs.frozen(kw_only=True)
class LaunchInfo:
    """Where this process sits in the job, as its launcher describes it.

    Example:
        >>> parse_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launcher
        'slurm'
    """

    launcher: Launcher
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    # True when the rendezvous store already runs elsewhere (torchrun's agent,
    # or a test harness), so rank 0 must connect to it rather than host it.
    external_store: bool
    # Which attempt of the job this is: torchrun's TORCHELASTIC_RESTART_COUNT (0 on the first
    # run, +1 each time the agent restarts the workers), so each attempt meets apart.
    attempt: int = 0


@attrs.frozen
class _Launcher:
    name: Launcher
    rank: str
    world_size: str
    local_rank: str | None
    local_world_size: str | None
    node_rank: str | None


_TORCHRUN = _Launcher("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
_SLURM = _Launcher(
    "slurm",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_NODEID",
)
_MPI = _Launcher(
    "mpi",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    None,
)
# Schedulers that start this process directly; torchrun is handled first.
_PEERS = (_SLURM, _MPI)
# The launchers understood, innermost first (whose variables win).
LAUNCHERS: tuple[str, ...] = tuple(row.name for row in (_TORCHRUN, *_PEERS))
# SLURM's fallbacks for the rendezvous when MASTER_ADDR / MASTER_PORT are unset.
_SLURM_NODELIST = "SLURM_NODELIST"
_SLURM_JOB_ID = "SLURM_JOB_ID"
# Read for every launcher: where the processes meet, and who hosts the store.
_MASTER_ADDR = "MASTER_ADDR"
_MASTER_PORT = "MASTER_PORT"
_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"

#: faccel's own options in the environment: ``DistState`` field -> variable.
#: Read by ``faccel._dist._state.state_from_env``; an explicit argument wins over each.
OPTION_VARIABLES: Mapping[str, str] = MappingProxyType(
    {
        "precision": "FACCEL_PRECISION",
        "accumulation_steps": "FACCEL_ACCUMULATION_STEPS",
        "strategy": "FACCEL_STRATEGY",
        "timeout": "FACCEL_TIMEOUT",
        "train_timeout": "FACCEL_TRAIN_TIMEOUT",
        "layout": "FACCEL_LAYOUT",
        # A DeepSpeed config file's path: read by detect() (faccel._dist._process_group), which selects
        # strategy='deepspeed' unless FACCEL_STRATEGY says otherwise (then the two are refused).
        "deepspeed": "FACCEL_DEEPSPEED_CONFIG",
    }
)


def _row_variables(row: _Launcher) -> tuple[str, ...]:
    names = (row.rank, row.world_size, row.local_rank, row.local_world_size, row.node_rank)
    return tuple(name for name in names if name is not None)


#: Every environment variable faccel reads, by who sets it: each launcher of
#: :data:`LAUNCHERS`, ``"rendezvous"`` (any launcher) and ``"faccel"`` (the options).
#: Built from the tables the parsing uses, so it cannot drift from them.
ENV_VARIABLES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        _TORCHRUN.name: _row_variables(_TORCHRUN),
        _SLURM.name: (*_row_variables(_SLURM), _SLURM_NODELIST, _SLURM_JOB_ID),
        _MPI.name: _row_variables(_MPI),
        "rendezvous": (_MASTER_ADDR, _MASTER_PORT, _AGENT_STORE, _RESTART_COUNT),
        "faccel": tuple(OPTION_VARIABLES.values()),
    }
)


def deepspeed_environment(local_rank: int) -> dict[str, str]:
    """What DeepSpeed's engine reads from the process environment, which faccel's launch may lack.

    DeepSpeed's engine asserts that ``LOCAL_RANK`` is set (torchrun sets it; a
    plain one-process run, SLURM and Open MPI do not). ``faccel._loop._strategies._deepspeed._engine``
    writes these variables where unset, just before it builds the engine: the one
    write of the process environment in faccel, listed here beside what faccel reads.

    Example:
        >>> deepspeed_environment(3)
        {'LOCAL_RANK': '3'}
    """
    return {"LOCAL_RANK": str(local_rank)}


# Counts and ranks beyond this are no real job: a bound, so no value read can be absurd.
MAX_INT = 2**31 - 1
# ASCII decimal digits only: Python's int() also takes "1_0", "+1", " 1", full-width
# and Arabic-Indic digits, none of which a launcher writes.
_DIGITS = re.compile(r"[0-9]{1,10}")


def read_int(env: Mapping[str, str], name: str, *, minimum: int, maximum: int = MAX_INT) -> int:
    """The variable ``name`` of ``env`` as an integer in ``[minimum, maximum]``, else a LaunchError.

    Example:
        >>> read_int({"RANK": "3"}, "RANK", minimum=0)
        3
        >>> read_int({"RANK": "0_1"}, "RANK", minimum=0)
        Traceback (most recent call last):
        ...
        faccel.errors.LaunchError: RANK must be a whole number in ASCII digits, got RANK='0_1'; ...
    """
    raw = env[name]
    if not _DIGITS.fullmatch(raw):
        msg = (
            f"{name} must be a whole number in ASCII digits, got {name}={raw!r}; "
            "check the launcher's environment"
        )
        raise LaunchError(msg)
    value = int(raw)
    if not minimum <= value <= maximum:
        msg = (
            f"{name} must be in [{minimum}, {maximum}], got {name}={raw!r}; check the launcher's environment"
        )
        raise LaunchError(msg)
    return value


def _slurm_tasks_per_node(raw: str) -> str:
    # SLURM writes "4(x2)" or "4,2" for heterogeneous nodes; the first entry is ours
    # only when the node counts are equal, which is the only layout DDP supports anyway.
    return raw.split(",")[0].split("(")[0]


def _read(env: Mapping[str, str], launcher: _Launcher) -> LaunchInfo | None:
    present = [k for k in (launcher.rank, launcher.world_size) if k in env]
    if not present:
        partial = [name for name in _row_variables(launcher) if name in env]
        if partial:
            # A launcher's local variables alone describe no job: one process would be a guess.
            msg = (
                f"{', '.join(f'{n}={env[n]!r}' for n in partial)} set without {launcher.rank} and "
                f"{launcher.world_size}; a {launcher.name} environment needs both (unset the others "
                "to run one process)"
            )
            raise LaunchError(msg)
        return None
    for key in (launcher.rank, launcher.world_size):
        if key not in env:
            msg = (
                f"{present[0]}={env[present[0]]!r} is set but {key} is not; "
                f"a {launcher.name} environment needs both {launcher.rank} and {launcher.world_size}"
            )
            raise LaunchError(msg)
    world_size = read_int(env, launcher.world_size, minimum=1)
    rank = read_int(env, launcher.rank, minimum=0)
    if rank >= world_size:
        msg = (
            f"{launcher.rank} must be in [0, {world_size}) since "
            f"{launcher.world_size}={env[launcher.world_size]!r}, "
            f"got {launcher.rank}={env[launcher.rank]!r}; "
            "check the launcher's environment"
        )
        raise LaunchError(msg)

    # This launcher's own variables only: copying all of ``env`` would read every variable.
    view = {name: env[name] for name in _row_variables(launcher) if name in env}
    if launcher.local_world_size and launcher is _SLURM and launcher.local_world_size in view:
        view[launcher.local_world_size] = _slurm_tasks_per_node(view[launcher.local_world_size])
    has_local = launcher.local_rank is not None and launcher.local_rank in view
    has_local_size = launcher.local_world_size is not None and launcher.local_world_size in view
    # Without local variables the launch is a single node: a documented default,
    # not a guess, since every multi-node launcher sets them.
    local_world_size = (
        read_int(view, launcher.local_world_size, minimum=1) if has_local_size else world_size  # type: ignore[arg-type]
    )
    local_rank = read_int(view, launcher.local_rank, minimum=0) if has_local else rank  # type: ignore[arg-type]
    if local_world_size > world_size:
        msg = (
            f"{launcher.local_world_size} must be <= {launcher.world_size}={world_size}, "
            f"got {launcher.local_world_size}={view[launcher.local_world_size]!r}"  # type: ignore[index]
        )
        raise LaunchError(msg)
    if local_rank >= local_world_size:
        name = launcher.local_rank or launcher.rank
        msg = (
            f"{name} must be in [0, {local_world_size}), got {name}={view.get(name, str(local_rank))!r}; "
            "check the launcher's environment"
        )
        raise LaunchError(msg)
    node_rank = rank // local_world_size
    if launcher.node_rank is not None and launcher.node_rank in view:
        given = read_int(view, launcher.node_rank, minimum=0)
        if given != node_rank:
            msg = (
                f"{launcher.node_rank}={view[launcher.node_rank]!r} contradicts {launcher.rank}={rank} "
                f"with {local_world_size} processes per node (node {node_rank}); "
                "check the launcher's environment"
            )
            raise LaunchError(msg)
    return LaunchInfo(
        launcher=launcher.name,
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=None,
        master_port=None,
        external_store=False,
    )


# A host name, then optionally its first bracketed number range, then more hosts.
_SLURM_HOSTS = re.compile(r"([A-Za-z0-9._-]+)(?:\[([0-9]+)(?:-[0-9]+)?(?:,[^\]]*)?\])?(?:,.*)?")


def _first_slurm_host(nodelist: str) -> str:
    # "node[03-05,07],gpu1" -> "node03": enough of scontrol's syntax for the first host.
    match = _SLURM_HOSTS.fullmatch(nodelist.strip())
    if not match:
        msg = (
            f"SLURM_NODELIST={nodelist!r} names no host faccel can read; "
            "set MASTER_ADDR to rank 0's host name"
        )
        raise LaunchError(msg)
    return match.group(1) + (match.group(2) or "")


def _rendezvous(env: Mapping[str, str], info: LaunchInfo) -> LaunchInfo:
    addr = env.get(_MASTER_ADDR)
    if addr is None and info.launcher == _SLURM.name and _SLURM_NODELIST in env:
        addr = _first_slurm_host(env[_SLURM_NODELIST])
    port: int | None = None
    if _MASTER_PORT in env:
        port = read_int(env, _MASTER_PORT, minimum=1)
        if port > 65535:
            msg = f"MASTER_PORT must be in [1, 65535], got MASTER_PORT={env[_MASTER_PORT]!r}"
            raise LaunchError(msg)
    elif info.launcher == _SLURM.name and _SLURM_JOB_ID in env:
        # Every task of a job derives the same port from the job id (as Lightning does).
        port = 15000 + read_int(env, _SLURM_JOB_ID, minimum=0) % 20000
    if info.world_size > 1 and not addr:
        msg = (
            f"WORLD_SIZE is {info.world_size} (from {info.launcher}) but MASTER_ADDR is not set; "
            "set MASTER_ADDR to rank 0's host name so the processes can meet, or launch with torchrun"
        )
        raise LaunchError(msg)
    if info.world_size > 1 and port is None:
        msg = (
            f"WORLD_SIZE is {info.world_size} (from {info.launcher}) but MASTER_PORT is not set; "
            "set MASTER_PORT to a free port on rank 0's host, or launch with torchrun"
        )
        raise LaunchError(msg)
    external = env.get(_AGENT_STORE) == "True"
    attempt = read_int(env, _RESTART_COUNT, minimum=0) if _RESTART_COUNT in env else 0
    return attrs.evolve(
        info, master_addr=addr or None, master_port=port, external_store=external, attempt=attempt
    )


def _check_agree(first: LaunchInfo, second: LaunchInfo) -> None:
    rows = {_SLURM.name: _SLURM, _MPI.name: _MPI}
    a, b = rows[first.launcher], rows[second.launcher]
    for field, left, right in (
        ("rank", a.rank, b.rank),
        ("world_size", a.world_size, b.world_size),
        ("local_rank", a.local_rank, b.local_rank),
        ("local_world_size", a.local_world_size, b.local_world_size),
    ):
        if getattr(first, field) != getattr(second, field):
            msg = (
                f"two launchers disagree about this process: {left}={getattr(first, field)} but "
                f"{right}={getattr(second, field)}; unset the variables of the launcher that did "
                "not start this process"
            )
            raise LaunchError(msg)


def parse_launch(env: Mapping[str, str]) -> LaunchInfo:
    """Read the launcher's variables from ``env`` into a :class:`LaunchInfo`.

    Pure: depends on ``env`` alone, and looks up only the variables of
    :data:`ENV_VARIABLES`. A missing launcher means one process.

    Args:
        env: The environment, usually ``os.environ``.

    Returns:
        The rank, world size, local rank and size, node rank and rendezvous
        address that the launcher described.

    Raises:
        LaunchError: A variable is malformed or out of range, a partner is
            missing, two launchers disagree, or a multi-process launch has no
            rendezvous address.

    Example:
        >>> info = parse_launch({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
        >>> (info.launcher, info.rank, info.world_size, info.local_rank)
        ('torchrun', 1, 2, 1)
    """
    torchrun = _read(env, _TORCHRUN)
    peers = [info for info in (_read(env, launcher) for launcher in _PEERS) if info is not None]
    if torchrun is None and len(peers) > 1:
        _check_agree(peers[0], peers[1])
    chosen = torchrun or (peers[0] if peers else None)
    if chosen is None:
        chosen = LaunchInfo(
            launcher="none",
            rank=0,
            local_rank=0,
            world_size=1,
            local_world_size=1,
            node_rank=0,
            master_addr=None,
            master_port=None,
            external_store=False,
        )
    return _rendezvous(env, chosen)


def rank_and_world(env: Mapping[str, str]) -> tuple[int, int]:
    """The launcher's rank and world size in ``env`` (0 of 1 without one), as :func:`parse_launch` reads them.

    For a reader that needs only where this process sits (a logger made
    before any ``DistState``): no rendezvous address is required.

    Raises:
        LaunchError: As :func:`parse_launch`, for the launcher's own variables.

    Example:
        >>> rank_and_world({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"})
        (3, 4)
        >>> rank_and_world({})
        (0, 1)
    """
    torchrun = _read(env, _TORCHRUN)
    peers = [info for info in (_read(env, launcher) for launcher in _PEERS) if info is not None]
    chosen = torchrun or (peers[0] if peers else None)
    return (0, 1) if chosen is None else (chosen.rank, chosen.world_size)
