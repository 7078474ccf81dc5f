"""``prepare``'s options as one typed record, the seam between ``prepare`` and its handlers.

``prepare`` takes its options as keywords (the names an Accelerate user knows);
it packs them once into :class:`PrepareOptions`, and every handler (the model
wrapping in ``_model``, the loader in ``_data``) reads fields, not string keys,
so a renamed or missing option is a type error at the seam, not a ``KeyError``
deep in a wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from torch import nn

from faccel._choices import INIT, OFFLOAD, WORKER_SEEDS, CommHookName, Init, Offload, WorkerSeeds
from faccel._loop._activation_checkpoint import Selector, check_selector
from faccel.errors import ArgumentValueError

__all__ = ["OFFLOADS", "PrepareOptions"]

# prepare's offload values: where FSDP2 keeps the sharded parameters between uses.
OFFLOADS = OFFLOAD.values


def _check_selector(options: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        check_selector(value)


def _check_offload(options: Any, attribute: Any, value: Any) -> None:
    OFFLOAD.check(value)


def _check_worker_seeds(options: Any, attribute: Any, value: Any) -> None:
    WORKER_SEEDS.check(value)


def _check_init(options: Any, attribute: Any, value: Any) -> None:
    if not callable(value):
        INIT.check(value)


def _check_bool(options: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        msg = f"{attribute.name} must be True or False, got {value!r}"
        raise ArgumentValueError(msg)


@attrs.frozen(kw_only=True)
class PrepareOptions:
    """What ``prepare`` was asked for beyond the objects; see ``faccel.prepare`` for each field.

    Example:
        >>> PrepareOptions().init, PrepareOptions(split_batches=True).split_batches
        ('reset', True)
        >>> PrepareOptions(offload="cpu").asks_fsdp, PrepareOptions().asks_fsdp
        (True, False)
    """

    even_batches: bool = True
    ddp_kwargs: Mapping[str, Any] | None = None
    shard_policy: Callable[[nn.Module], bool] | None = None
    split_batches: bool = False
    worker_seeds: WorkerSeeds = attrs.field(default="rank", validator=_check_worker_seeds)
    tp_plan: Mapping[str, Any] | None = None
    init: Init | Callable[[nn.Module], None] = attrs.field(default="reset", validator=_check_init)
    activation_checkpointing: Selector | None = attrs.field(default=None, validator=_check_selector)
    offload: Offload | None = attrs.field(default=None, validator=_check_offload)
    reshard_after_forward: bool = attrs.field(default=True, validator=_check_bool)
    # Pipeline stages (faccel._loop._strategies._pipeline): where the model is cut, and the schedule.
    split: Sequence[str] | Callable[[int, int], nn.Module] | None = None
    schedule: Any = None
    # A batch (this rank's, as forward_backward gets it): the stages are built at prepare from its shapes.
    example: Any = None
    comm_hook: CommHookName | None = None
    comm_hook_options: Mapping[str, Any] | None = None

    @property
    def asks_fsdp(self) -> bool:
        """Whether an FSDP2-only option differs from its default (``offload``, ``reshard_after_forward``)."""
        return self.offload is not None or not self.reshard_after_forward
