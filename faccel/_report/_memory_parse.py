"""The candidate layouts of a memory plan, as ``python -m faccel plan --layouts`` spells them: a table.

Each named spelling (``ddp``, ``fsdp``, ``hsdp:RxS``, ``tp:T``, ``pp:P``) is
one row: the layout dimensions its sizes fill, in order, and the dimension
that takes the ranks left over (the world size divided by the sizes given).
A bare grid ``RxSxT`` fills :data:`GRID`'s dimensions in order; anything else
is read as ``str(Layout)`` writes a layout (``replicate=2,shard=4``).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from faccel._dist._layout import Layout, parse_layout
from faccel.errors import ArgumentValueError

__all__ = ["GRID", "parse_candidate"]


@attrs.frozen(kw_only=True)
class _Spelling:
    """One named candidate: the dimensions its ``x``-separated sizes set, and the one given the rest."""

    sizes: tuple[str, ...]
    rest: str | None


# name -> its spelling. "ddp" and "fsdp" take no sizes: every rank replicates, or every rank shards.
_SPELLINGS: Mapping[str, _Spelling] = {
    "ddp": _Spelling(sizes=(), rest="replicate"),
    "fsdp": _Spelling(sizes=(), rest="shard"),
    "hsdp": _Spelling(sizes=("replicate", "shard"), rest=None),
    "tp": _Spelling(sizes=("tensor",), rest="shard"),
    "pp": _Spelling(sizes=("pipeline",), rest="shard"),
}
#: The dimensions a bare grid ``RxSxT`` sets, in order.
GRID = ("replicate", "shard", "tensor")
_FORMS = "'ddp', 'fsdp', 'hsdp:RxS', 'tp:T', 'pp:P', 'RxSxT' or 'replicate=R,shard=S,tensor=T'"


def _sizes(text: str, names: tuple[str, ...]) -> dict[str, int]:
    """``text``'s ``x``-separated sizes, one for each of ``names`` (as many as there are names)."""
    parts = text.split("x") if text else []
    if len(parts) != len(names) or not all(part.strip().isdigit() for part in parts):
        spelled = "x".join(name[0].upper() for name in names) or "nothing"
        msg = f"expected {spelled} ({', '.join(names) or 'no sizes'}), got {text!r}"
        raise ValueError(msg)
    return {name: int(part) for name, part in zip(names, parts, strict=True)}


def _layout(text: str, world_size: int) -> Layout:
    name, colon, given = text.strip().partition(":")
    spelling = _SPELLINGS.get(name)
    if spelling is not None and (colon or not spelling.sizes):
        sizes = _sizes(given, spelling.sizes)
        if spelling.rest is not None:
            taken = 1
            for size in sizes.values():
                taken *= size
            sizes[spelling.rest] = max(world_size // max(taken, 1), 1)
        return Layout(**sizes)
    if "x" in text and "=" not in text:
        return Layout(**_sizes(text.strip(), GRID))
    return parse_layout(text)


def parse_candidate(text: str, world_size: int) -> Layout:
    """The layout a candidate names: ``ddp``, ``fsdp``, ``hsdp:RxS``, ``tp:T``, ``pp:P`` (FSDP2 then), a grid.

    A grid is ``RxSxT`` (replicate x shard x tensor: ``2x2x2``) or a layout as
    ``str(Layout)`` writes it (``replicate=2,shard=4``).

    Raises:
        ArgumentValueError: An unknown spelling, or sizes whose product is not ``world_size``.

    Example:
        >>> parse_candidate("ddp", 8), parse_candidate("hsdp:2x4", 8)
        (Layout(replicate=8, shard=1, tensor=1), Layout(replicate=2, shard=4, tensor=1))
        >>> parse_candidate("tp:2", 8), parse_candidate("2x2x2", 8)
        (Layout(replicate=1, shard=4, tensor=2), Layout(replicate=2, shard=2, tensor=2))
        >>> parse_candidate("pp:2", 8)
        Layout(replicate=1, shard=4, tensor=1, pipeline=2)
    """
    try:
        layout = _layout(text, world_size)
    except (ValueError, ArgumentValueError) as error:
        msg = f"a candidate layout is {_FORMS}, got {text!r} ({error})"
        raise ArgumentValueError(msg) from None
    if layout.world_size != world_size:
        msg = f"candidate {text!r} is {layout}, {layout.world_size} ranks, but the world size is {world_size}"
        raise ArgumentValueError(msg)
    return layout
