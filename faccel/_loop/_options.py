"""``prepare``'s options as one typed record, the seam between ``prepare`` and its handlers.

``prepare`` takes its options as keywords (the names an Accelerate user knows);
it packs them once into :class:`PrepareOptions`, and every handler (the model
wrapping in ``_model``, the loader in ``_data``) reads fields, not string keys,
so a renamed or missing option is a type error at the seam, not a ``KeyError``
deep in a wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
from torch import nn

__all__ = ["PrepareOptions"]


@attrs.frozen(kw_only=True)
class PrepareOptions:
    """What ``prepare`` was asked for beyond the objects; see ``faccel.prepare`` for each field.

    Example:
        >>> PrepareOptions().init, PrepareOptions(split_batches=True).split_batches
        ('reset', True)
    """

    even_batches: bool = True
    ddp_kwargs: Mapping[str, Any] | None = None
    shard_policy: Callable[[nn.Module], bool] | None = None
    split_batches: bool = False
    worker_seeds: str = "rank"
    tp_plan: Mapping[str, Any] | None = None
    init: str | Callable[[nn.Module], None] = "reset"
