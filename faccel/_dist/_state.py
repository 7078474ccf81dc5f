"""DistState: the static facts of a run, and ``state_from_env`` that derives them. Pure.

``state_from_env`` takes the environment and the hardware it may use as
arguments; nothing here reads ``os.environ``, asks the hardware or starts a
process group. :func:`faccel.detect`, the thin edge that does, lives in
``faccel._dist._process_group``, which imports this module (never the reverse).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from faccel._choices import PRECISION, STRATEGY, Backend, Launcher, Precision, Strategy
from faccel._dist._launch import OPTION_VARIABLES, parse_launch, read_int
from faccel._dist._layout import Layout, default_layout, layout_problem, parse_layout, strategy_for
from faccel._dist._runtime import Runtime
from faccel._typecheck import Settings, setup_checked
from faccel.errors import ArgumentValueError, LaunchError

__all__ = ["DEFAULT_TIMEOUT", "PRECISIONS", "DistState", "state_from_env"]

# precision name -> autocast dtype (None: full precision, no autocast).
PRECISIONS: Mapping[str, torch.dtype | None] = {
    "no": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
# device type -> default process-group backend.
_BACKENDS: Mapping[str, Backend] = {"cuda": "nccl", "cpu": "gloo", "mps": "gloo", "xpu": "xccl"}
# backend -> device types it can move tensors of.
_BACKEND_DEVICES: Mapping[str, frozenset[str]] = {
    "gloo": frozenset({"cpu", "cuda", "mps"}),
    "nccl": frozenset({"cuda"}),
    "mpi": frozenset({"cpu", "cuda"}),
    "xccl": frozenset({"xpu"}),
}
# How long a collective waits for the other ranks unless told otherwise: long enough for
# ordinary skew between ranks, short enough that a hung rank ends the job within
# minutes, not torch's 30 (docs/distributed.md, "When a rank hangs").
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
# FACCEL_TIMEOUT's grammar: ASCII digits, an optional decimal part; at most ~115 days.
_SECONDS = re.compile(r"[0-9]{1,7}(\.[0-9]{1,6})?")
# How a model is spread over the processes: DDP replicates it, FSDP2 shards it, DeepSpeed's
# ZeRO partitions it (faccel._loop._strategies._deepspeed._engine).
STRATEGIES = frozenset(STRATEGY.values)


def _check_precision(_: object, attribute: attrs.Attribute, value: str) -> None:  # type: ignore[type-arg]
    PRECISION.check(value)  # a PrecisionError (an ArgumentValueError) naming the values


def _check_strategy(_: object, attribute: attrs.Attribute, value: str) -> None:  # type: ignore[type-arg]
    STRATEGY.check(value)  # a LaunchError (an ArgumentValueError) naming the values


def _positive(_: object, attribute: attrs.Attribute, value: int) -> None:  # type: ignore[type-arg]
    if value < 1:
        msg = f"{attribute.name} must be >= 1, got {value!r}"
        raise LaunchError(msg)


@attrs.frozen(kw_only=True)
class DistState(Settings):
    """The static facts of a run: where this process sits, what it computes on, how.

    A frozen record: update with ``attrs.evolve``. Two records with different
    settings can live side by side in one process; the process group they
    describe is PyTorch's own (one per process), started by :func:`detect`.

    Attributes:
        rank: This process's index in ``[0, world_size)``.
        local_rank: Its index among the processes on this node.
        world_size: Number of processes in the job.
        local_world_size: Number of processes on this node.
        node_rank: Index of this node.
        device: Where models and batches go.
        backend: The ``torch.distributed`` backend (``gloo``, ``nccl``...).
        precision: ``'no'``, ``'bf16'`` or ``'fp16'``.
        accumulation_steps: Micro-batches per optimizer step.
        strategy: ``'ddp'`` (replicate the model) or ``'fsdp'`` (shard it with
            FSDP2's ``fully_shard``), used when there are peer processes.
        seed: Seed of the data order (shuffling is a function of seed and epoch).
        timeout: How long a collective waits for the other ranks.
        train_timeout: A shorter wait once training has warmed up (from the
            second optimizer step: the first one's compiles, allocations and DDP
            bucket rebuilds are over), so that a hang in the loop ends sooner than
            one at set-up may; None keeps ``timeout`` throughout.
        launcher: Who started the process: ``torchrun``, ``slurm``, ``mpi``,
            ``none`` (plain ``python``) or ``simulated``.
        master_addr: Rendezvous host, for more than one process.
        master_port: Rendezvous port, for more than one process.
        external_store: Whether the rendezvous store is hosted by the launcher.
        attempt: Which attempt of the job this is (torchrun's
            ``TORCHELASTIC_RESTART_COUNT``: 0, then 1 after the agent's first
            restart ...); each attempt meets under its own keys of the store.
        layout: How the ranks split into pipeline stages, replicas, shards,
            context and tensor-parallel groups (:class:`Layout`); None: as ``strategy`` says (DDP
            replicates over every rank, FSDP shards over them). The one in
            effect is :attr:`parallel`.
        runtime: The process's resources for this run (:class:`faccel._dist._runtime.Runtime`:
            the background checkpoint and its staging buffers, the meshes, the
            shutdown hooks, the loaders' iteration records, the last-call
            breadcrumb). A handle, not a fact: it takes no part in equality,
            hashing or ``repr``; each new record gets its own, ``attrs.evolve``
            keeps it, and :func:`faccel.shutdown` closes it.
        deepspeed: Under ``strategy='deepspeed'``: the DeepSpeed config as
            canonical JSON text (``faccel._dist._deepspeed_config.read_config``), which
            ``prepare`` completes (docs/deepspeed.md); None otherwise.

    Example:
        >>> import attrs
        >>> dist = DistState(precision="bf16")
        >>> attrs.evolve(dist, accumulation_steps=4).accumulation_steps, dist.accumulation_steps
        (4, 1)
    """

    rank: int = attrs.field(default=0)
    local_rank: int = 0
    world_size: int = attrs.field(default=1, validator=_positive)
    local_world_size: int = attrs.field(default=1, validator=_positive)
    node_rank: int = 0
    device: torch.device = attrs.field(default=torch.device("cpu"), converter=torch.device)
    backend: Backend = "gloo"
    precision: Precision = attrs.field(default="no", validator=_check_precision)
    accumulation_steps: int = attrs.field(default=1, validator=_positive)
    strategy: Strategy = attrs.field(default="ddp", validator=_check_strategy)
    seed: int = 0
    timeout: datetime.timedelta = DEFAULT_TIMEOUT
    train_timeout: datetime.timedelta | None = None
    launcher: Launcher = "none"
    master_addr: str | None = None
    master_port: int | None = None
    external_store: bool = False
    layout: Layout | None = None
    runtime: Runtime = attrs.field(factory=Runtime, eq=False, repr=False)
    attempt: int = 0
    deepspeed: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.deepspeed is not None) != (self.strategy == "deepspeed"):
            msg = (
                f"strategy={self.strategy!r} with deepspeed config "
                f"{'given' if self.deepspeed is not None else 'None'}: a DeepSpeed config goes with "
                "strategy='deepspeed' and only with it; pass both (or neither)"
            )
            raise LaunchError(msg)
        if self.layout is not None:
            problem = layout_problem(self.layout, self.world_size, self.strategy)
            if problem:
                raise LaunchError(problem)
        if not 0 <= self.rank < self.world_size:
            msg = f"rank must be in [0, {self.world_size}), got {self.rank!r}"
            raise LaunchError(msg)
        if not 0 <= self.local_rank < self.local_world_size:
            msg = f"local_rank must be in [0, {self.local_world_size}), got {self.local_rank!r}"
            raise LaunchError(msg)

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on local rank 0 (one process per node)."""
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        """True when real peer processes exist (world size > 1 and not simulated)."""
        return self.world_size > 1 and self.launcher != "simulated"

    @property
    def parallel(self) -> Layout:
        """The layout in effect: ``layout``, else the one ``strategy`` implies."""
        if self.layout is not None:
            return self.layout
        return default_layout(self.strategy, self.world_size)

    @property
    def data_rank(self) -> int:
        """This process's data-parallel rank: which share of each epoch its loaders read."""
        return self.rank if self.layout is None else self.layout.data_rank(self.rank)

    @property
    def data_world_size(self) -> int:
        """Data-parallel ranks: how many ways the loaders deal each epoch (world size over tensor size)."""
        return self.world_size if self.layout is None else self.layout.data_size

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype of ``precision``, or None for full precision."""
        return PRECISIONS[self.precision]

    @classmethod
    def simulated(
        cls,
        *,
        rank: int = 0,
        world_size: int = 1,
        local_world_size: int | None = None,
        device: str | torch.device = "cpu",
        precision: Precision = "no",
        accumulation_steps: int = 1,
        strategy: Strategy | None = None,
        seed: int = 0,
        layout: Layout | None = None,
    ) -> DistState:
        """A record for rank ``rank`` of a ``world_size`` job, with no process group.

        For tests and for planning: data sharding, accumulation boundaries and
        checkpoint layouts behave exactly as on that rank. There are no peers,
        so ``prepare`` does not wrap models in DDP and collectives are refused.

        Example:
            >>> s = DistState.simulated(rank=3, world_size=8)
            >>> (s.rank, s.world_size, s.is_main_process, s.distributed)
            (3, 8, False, False)
            >>> s = DistState.simulated(rank=3, world_size=4, layout=Layout(shard=2, tensor=2))
            >>> (s.strategy, s.data_rank, s.data_world_size)
            ('fsdp', 1, 2)
        """
        lws = world_size if local_world_size is None else local_world_size
        return cls(
            rank=rank,
            local_rank=rank % lws,
            world_size=world_size,
            local_world_size=lws,
            node_rank=rank // lws,
            device=torch.device(device),
            backend=_BACKENDS.get(torch.device(device).type, "gloo"),
            precision=precision,
            accumulation_steps=accumulation_steps,
            strategy=strategy if strategy is not None else _strategy_of(layout),
            seed=seed,
            launcher="simulated",
            layout=layout,
        )


def _choose_device(
    requested: str | torch.device | None, local_rank: int, cuda_count: int, mps_available: bool
) -> torch.device:
    if requested is not None:
        device = torch.device(requested)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local_rank)
        if device.type == "cuda" and device.index is not None and device.index >= cuda_count:
            msg = (
                f"device {str(device)!r} was asked for but {cuda_count} CUDA device(s) are visible; "
                "check CUDA_VISIBLE_DEVICES or pass device='cpu'"
            )
            raise LaunchError(msg)
        return device
    if cuda_count > 0:
        if local_rank >= cuda_count:
            msg = (
                f"LOCAL_RANK={local_rank} needs a GPU of its own but only {cuda_count} CUDA device(s) "
                "are visible; start at most that many processes per node, or pass device='cpu'"
            )
            raise LaunchError(msg)
        return torch.device("cuda", local_rank)
    if mps_available:
        return torch.device("mps")
    return torch.device("cpu")


def _env_int(env: Mapping[str, str], name: str, given: int | None, default: int) -> int:
    if given is not None:
        return given
    return read_int(env, name, minimum=1) if name in env else default


def _strategy_of(layout: Layout | None) -> Any:
    """The strategy a layout implies (``'ddp'`` without one): one of :data:`Strategy`'s words."""
    return strategy_for(layout) if layout else "ddp"


def _env_choice(
    env: Mapping[str, str], name: str, given: str | None, default: str, choices: Iterable[str]
) -> Any:  # one of ``choices`` (a Literal type's words), or ``given`` for DistState's own check
    if given is not None:
        return given  # an argument: DistState's own check names it
    value = env.get(name, default)
    if value not in choices:
        msg = f"{name} must be one of {sorted(choices)}, got {name}={value!r}; fix or unset the variable"
        raise LaunchError(msg)
    return value


def _env_layout(env: Mapping[str, str], given: Layout | str | None) -> Layout | None:
    name = OPTION_VARIABLES["layout"]
    text = given if given is not None else env.get(name)
    if text is None or isinstance(text, Layout):
        return text
    try:
        return parse_layout(text)
    except ArgumentValueError as error:
        where = "layout=" if given is not None else f"{name}="
        msg = f"{where}{text!r}: {error}"
        raise LaunchError(msg) from None


def _env_timeout(env: Mapping[str, str], option: str = "timeout") -> datetime.timedelta | None:
    name = OPTION_VARIABLES[option]
    if name not in env:
        return DEFAULT_TIMEOUT if option == "timeout" else None
    raw = env[name]
    # Strict, like RANK (``read_int``): float() also takes "1_0", "1e-6", " 10" and
    # non-ASCII digits, none of which anyone means as a number of seconds.
    timeout = datetime.timedelta(0)
    if _SECONDS.fullmatch(raw):
        timeout = datetime.timedelta(seconds=float(raw))
    if timeout <= datetime.timedelta(0):
        msg = (
            f"{name} must be a positive number of seconds, got {name}={raw!r}; write ASCII digits "
            f"with an optional decimal part ({name}=30 or 12.5), or unset it for the default"
            + (f" ({DEFAULT_TIMEOUT.total_seconds():.0f} s)" if option == "timeout" else " (none)")
        )
        raise LaunchError(msg)
    return timeout


@setup_checked
def state_from_env(
    env: Mapping[str, str],
    *,
    cuda_count: int = 0,
    mps_available: bool = False,
    device: str | torch.device | None = None,
    precision: Precision | None = None,
    backend: Backend | None = None,
    accumulation_steps: int | None = None,
    strategy: Strategy | None = None,
    seed: int = 0,
    timeout: datetime.timedelta | None = None,
    layout: Layout | str | None = None,
    train_timeout: datetime.timedelta | None = None,
    deepspeed: str | None = None,
) -> DistState:
    """The :class:`DistState` that ``env`` and the given hardware describe. Pure.

    Options override the environment: ``precision`` over ``FACCEL_PRECISION``,
    ``accumulation_steps`` over ``FACCEL_ACCUMULATION_STEPS``, ``strategy``
    over ``FACCEL_STRATEGY``, ``timeout`` over ``FACCEL_TIMEOUT`` (seconds),
    ``layout`` over ``FACCEL_LAYOUT``
    (``faccel._dist._launch.OPTION_VARIABLES``). Looks up
    no variable outside ``faccel._dist._launch.ENV_VARIABLES``.

    Args:
        env: The launcher's environment.
        cuda_count: CUDA devices visible to this process.
        mps_available: Whether Apple's MPS device can be used.
        device: Force a device (``'cpu'``, ``'cuda'``, ``'cuda:1'``...).
        precision: ``'no'``, ``'bf16'`` or ``'fp16'``.
        backend: Force a ``torch.distributed`` backend.
        accumulation_steps: Micro-batches per optimizer step.
        strategy: ``'ddp'`` or ``'fsdp'``.
        seed: Seed of the data order.
        timeout: How long collectives wait for the other ranks; default
            ``$FACCEL_TIMEOUT`` seconds, else :data:`DEFAULT_TIMEOUT` (5 minutes).
        train_timeout: The shorter wait once training has warmed up; default
            ``$FACCEL_TRAIN_TIMEOUT`` seconds, else None (``timeout`` throughout).
        layout: A :class:`Layout` or its text (``'shard=2,tensor=2'``); default
            ``$FACCEL_LAYOUT``, else None (the strategy's). Without a strategy
            given, a layout with shards or tensor parallelism selects ``'fsdp'``.
        deepspeed: The DeepSpeed config as JSON text, for ``strategy='deepspeed'``.

    Raises:
        LaunchError: The environment is malformed (``FACCEL_TIMEOUT`` not a
            positive number of seconds, say), the strategy is unknown, the
            layout is malformed, does not span the world size or contradicts the
            strategy, or the device or backend cannot serve this process.
            Also a ``deepspeed`` config without ``strategy='deepspeed'``, or the reverse.
        PrecisionError: Unknown precision.
        ArgumentError: An argument of the wrong type.

    Example:
        >>> s = state_from_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
        ...                     "MASTER_PORT": "29500"}, precision="bf16")
        >>> (s.rank, s.world_size, str(s.device), s.backend, s.precision)
        (1, 2, 'cpu', 'gloo', 'bf16')
    """
    info = parse_launch(env)
    chosen_layout = _env_layout(env, layout)
    chosen_strategy: Any = strategy
    if chosen_strategy is None and OPTION_VARIABLES["strategy"] not in env and chosen_layout is not None:
        chosen_strategy = strategy_for(chosen_layout)
    chosen_strategy = _env_choice(env, OPTION_VARIABLES["strategy"], chosen_strategy, "ddp", STRATEGIES)
    if chosen_layout is not None and chosen_strategy in STRATEGIES:
        problem = layout_problem(chosen_layout, info.world_size, chosen_strategy)
        if problem:  # named here, where it is known whether the variable or the argument said it
            name = OPTION_VARIABLES["layout"]
            said = f"layout={str(layout)!r}" if layout is not None else f"{name}={env[name]!r}"
            msg = f"{said}: {problem}"
            raise LaunchError(msg)
    chosen = _choose_device(device, info.local_rank, cuda_count, mps_available)
    if chosen.type == "mps" and info.world_size > 1:
        msg = f"MPS supports one process only, got WORLD_SIZE={info.world_size}; pass device='cpu'"
        raise LaunchError(msg)
    chosen_backend = backend or _BACKENDS.get(chosen.type, "gloo")
    if chosen.type not in _BACKEND_DEVICES.get(chosen_backend, frozenset({chosen.type})):
        msg = (
            f"backend {chosen_backend!r} cannot serve device {str(chosen)!r}; "
            f"use backend={_BACKENDS.get(chosen.type, 'gloo')!r}"
        )
        raise LaunchError(msg)
    return DistState(
        rank=info.rank,
        local_rank=info.local_rank,
        world_size=info.world_size,
        local_world_size=info.local_world_size,
        node_rank=info.node_rank,
        device=chosen,
        backend=chosen_backend,
        precision=_env_choice(env, OPTION_VARIABLES["precision"], precision, "no", PRECISIONS),
        accumulation_steps=_env_int(env, OPTION_VARIABLES["accumulation_steps"], accumulation_steps, 1),
        strategy=chosen_strategy,
        seed=seed,
        timeout=timeout if timeout is not None else _env_timeout(env),  # type: ignore[arg-type]
        train_timeout=train_timeout if train_timeout is not None else _env_timeout(env, "train_timeout"),
        launcher=info.launcher,
        master_addr=info.master_addr,
        master_port=info.master_port,
        external_store=info.external_store,
        layout=chosen_layout,
        attempt=info.attempt,
        deepspeed=deepspeed if deepspeed is not None or chosen_strategy != "deepspeed" else "{}",
    )
