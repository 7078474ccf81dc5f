"""TrainState: what a checkpoint holds, as one frozen record."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn

from faccel._data._loader import PreparedLoader
from faccel.errors import ArgumentError, ArgumentValueError

__all__ = ["TrainState", "global_position"]


def _non_negative(_: object, attribute: attrs.Attribute, value: object) -> None:  # type: ignore[type-arg]
    msg = f"TrainState.{attribute.name} must be an int >= 0, got {value!r}"
    if type(value) is not int:  # bool is not a step count either
        raise ArgumentError(msg)
    if value < 0:
        raise ArgumentValueError(msg)


def _extras_keys(_: object, attribute: attrs.Attribute, value: Mapping[Any, Any]) -> None:  # type: ignore[type-arg]
    bad = [key for key in value if type(key) is not str]
    if bad:
        msg = (
            f"TrainState.{attribute.name} keys must be strings (they name the entries in the "
            f"checkpoint), got {bad!r}"
        )
        raise ArgumentError(msg)


def _prepared(_: object, attribute: attrs.Attribute, value: object) -> None:  # type: ignore[type-arg]
    if value is not None and not isinstance(value, PreparedLoader):
        msg = (
            f"TrainState.{attribute.name} must be the loader faccel.prepare returned (or None), "
            f"got {type(value).__name__}: its sharding is what places the position in the epoch"
        )
        raise ArgumentError(msg)


def _resumed_at(_: object, attribute: attrs.Attribute, value: object) -> None:  # type: ignore[type-arg]
    if value is None:
        return
    if not (isinstance(value, tuple) and len(value) == 2 and all(type(v) is int for v in value)):
        msg = f"TrainState.{attribute.name} must be None or a tuple (epoch, consumed) of ints, got {value!r}"
        raise ArgumentError(msg)
    if min(value) < 0:
        msg = f"TrainState.{attribute.name} must hold ints >= 0, got {value!r}"
        raise ArgumentValueError(msg)


@attrs.frozen(kw_only=True, eq=False)
class TrainState:
    """What changes during training and what a checkpoint holds.

    A frozen shell around live objects: ``model``, ``optimizer``, ``scheduler``
    and ``scaler`` are PyTorch's own mutable objects, and
    :func:`faccel.restore` loads into them in place; ``step``, ``epoch`` and
    ``position`` are plain values that you advance with ``attrs.evolve`` (no
    counter hides in a wrapper). Equality is identity: the record holds
    modules and tensors, which have no value equality.

    Attributes:
        model: The model, wrapped by :func:`faccel.prepare` or not.
        optimizer: Its optimizer, or None when the optimizer state lives
            elsewhere (functional training keeps it in ``extras``).
        scheduler: An LR scheduler, or None. Schedulers built on functions
            (``LambdaLR``) keep their functions: rebuild them as in PyTorch.
        scaler: A ``torch.amp.GradScaler`` for fp16 training, or None.
        step: Optimizer steps taken.
        epoch: The epoch in progress.
        position: Batches of ``epoch`` already consumed (by each rank, in
            batches of this world size); resume the loader with
            ``loader.resume(state)``.
        loader: The training loader :func:`faccel.prepare` returned (or any
            view of it), or None. Only its shape is saved (batch size, world
            size): with it, a checkpoint also records the global data position
            (positions of the epoch's order all ranks have read), so a restore
            at another world size can continue the epoch exactly; without it a
            mid-epoch checkpoint restores only at the world size that wrote it.
        resumed_at: ``(epoch, consumed)`` when ``epoch`` was resumed at another
            world size after all ranks had read ``consumed`` positions of its
            order (set by :func:`faccel.restore`); ``position`` then counts
            batches from there. Stale once ``epoch`` moves on: no need to
            reset it.
        extras: Anything else to keep, by name: JSON values (None, bool, int,
            float, str, and lists, tuples and dicts of them), bytes, NumPy
            arrays, tensors (nested in those containers too, so a pytree of
            tensors fits), or an object with ``state_dict()`` and
            ``load_state_dict()`` whose state is made of the same. Saved from
            the main process and restored on every rank: they must be equal
            on every rank (``checkpoint`` compares them and refuses ones that
            differ); per-rank values go to ``rank_extras``.
        rank_extras: Values of this rank alone, of the same kinds as
            ``extras`` (a prefetched batch, a per-rank counter): every rank
            saves its own (inside its ``rng-NNNNN.json``, tensors inline, so
            keep them small) and gets its own back. Restorable only with the
            world size that wrote them.

    Raises:
        ArgumentValueError: ``step``, ``epoch`` or ``position`` is negative.
        ArgumentError: ``step``, ``epoch`` or ``position`` is not an ``int``
            (a bool is not), a key of ``extras`` is not a string, ``loader``
            is not a prepared loader, or ``resumed_at`` not a pair of ints.

    Example:
        >>> import attrs, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> state = attrs.evolve(state, step=state.step + 1, position=state.position + 1)
        >>> (state.step, state.epoch, state.position)
        (1, 0, 1)
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    scaler: torch.amp.GradScaler | None = None
    step: int = attrs.field(default=0, validator=_non_negative)
    epoch: int = attrs.field(default=0, validator=_non_negative)
    position: int = attrs.field(default=0, validator=_non_negative)
    extras: Mapping[str, Any] = attrs.field(factory=dict, validator=_extras_keys)
    rank_extras: Mapping[str, Any] = attrs.field(factory=dict, validator=_extras_keys)
    loader: PreparedLoader | None = attrs.field(default=None, validator=_prepared)
    resumed_at: tuple[int, int] | None = attrs.field(default=None, validator=_resumed_at)

    @property
    def consumed(self) -> int:
        """Positions of ``epoch``'s global order read before the batches ``position`` counts.

        0 unless ``epoch`` was resumed at another world size (``resumed_at``).

        Example:
            >>> import torch
            >>> state = TrainState.create(model=torch.nn.Linear(1, 1), optimizer=None, epoch=2,
            ...                           resumed_at=(2, 48))
            >>> state.consumed, attrs.evolve(state, epoch=3).consumed
            (48, 0)
        """
        at = self.resumed_at
        return at[1] if at is not None and at[0] == self.epoch else 0

    @classmethod
    def create(
        cls,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        scaler: torch.amp.GradScaler | None = None,
        step: int = 0,
        epoch: int = 0,
        position: int = 0,
        extras: Mapping[str, Any] | None = None,
        rank_extras: Mapping[str, Any] | None = None,
        loader: PreparedLoader | None = None,
        resumed_at: tuple[int, int] | None = None,
    ) -> TrainState:
        """A state at the start of training (or wherever ``step``, ``epoch``, ``position`` say).

        Example:
            >>> import torch
            >>> model = torch.nn.Linear(2, 1)
            >>> state = TrainState.create(model=model, optimizer=torch.optim.Adam(model.parameters()),
            ...                           extras={"best_loss": None})
            >>> state.step, dict(state.extras)
            (0, {'best_loss': None})
        """
        return cls(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            step=step,
            epoch=epoch,
            position=position,
            extras=dict(extras or {}),
            rank_extras=dict(rank_extras or {}),
            loader=loader,
            resumed_at=resumed_at,
        )


def global_position(state: TrainState) -> int | None:
    """Positions of ``state.epoch``'s global order that all ranks together have read.

    From ``state.loader``'s sharding (this world size and batch size),
    ``state.consumed`` and ``state.position``: what a restore at any world size
    continues from. None without a loader, or for an ``IterableDataset``
    (whose stream is dealt as it is read).

    Example:
        >>> import torch, faccel
        >>> data = torch.utils.data.TensorDataset(torch.arange(10))
        >>> loader = faccel.prepare(faccel.DistState.simulated(rank=0, world_size=2),
        ...                         torch.utils.data.DataLoader(data, batch_size=3))
        >>> state = TrainState.create(model=torch.nn.Linear(1, 1), optimizer=None, position=1, loader=loader)
        >>> global_position(state)
        6
    """
    loader = state.loader
    if loader is None or loader.dataloader.batch_sampler is None:  # a stream: batches are built as read
        return None
    sharding = attrs.evolve(loader.sharding, consumed=state.consumed)
    return sharding.consumed_after(state.position)
