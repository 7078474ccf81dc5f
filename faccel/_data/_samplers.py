"""A user's sampler drawn as a pure function of ``(seed, epoch)``.

Every rank must draw the same epoch order without talking to the others, and a
resumed run must draw the order the interrupted one drew. A sampler's draw is
made a function of ``(seed, epoch)`` by drawing from a shallow copy of it whose
random sources are fixed first:

* a ``generator`` attribute (``RandomSampler``, ``WeightedRandomSampler``,
  ``SubsetRandomSampler``; a ``torch.Generator``, ``random.Random`` or numpy
  ``Generator``) is replaced by a new one seeded with ``seed + epoch``;
* ``set_epoch(epoch)`` is called where the sampler has it;
* the same is done to a wrapped ``sampler`` / ``batch_sampler`` attribute
  (a bucketing batch sampler over a random sampler);
* where no ``generator`` attribute was found, the global generators (torch's
  CPU one, ``random``, numpy's) are seeded with ``seed + epoch`` for the draw
  and restored after it, so a sampler that draws from them is covered too, and
  the caller's random streams are untouched.

What stays out of reach is *hidden state*: a generator the sampler keeps under
another name and advances from draw to draw, or a counter. :func:`check_repeatable`
catches it by drawing epoch 0 twice.
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from faccel.errors import PrepareError

__all__ = ["check_repeatable", "draw"]

# Wrapped samplers are seeded too, this many levels down.
_DEPTH = 3


def _reseeded(source: object, seed: int) -> object:
    """A new random source of ``source``'s kind seeded with ``seed``; ``source`` if not one."""
    if isinstance(source, torch.Generator):
        return torch.Generator(device=source.device).manual_seed(seed)
    if isinstance(source, random.Random):
        return random.Random(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(source, numpy.random.Generator):
        return numpy.random.default_rng(seed)
    if numpy is not None and isinstance(source, numpy.random.RandomState):
        return numpy.random.RandomState(seed % 2**32)
    return source


def _seeded_copy(sampler: Any, seed: int, epoch: int, seeded: list[bool], depth: int = _DEPTH) -> Any:
    """A shallow copy of ``sampler`` whose random sources follow ``(seed, epoch)``.

    ``seeded`` gets True appended for each ``generator`` attribute replaced.
    """
    try:
        twin = copy.copy(sampler)
    except Exception:  # an uncopyable sampler is drawn as it is (the probe judges it)
        return sampler
    if hasattr(twin, "generator"):
        source = twin.generator
        fresh = (
            torch.Generator().manual_seed(seed + epoch) if source is None else _reseeded(source, seed + epoch)
        )
        twin.generator = fresh
        seeded.append(fresh is not source)
    set_epoch = getattr(twin, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    if depth > 1:
        for name in ("sampler", "batch_sampler"):
            inner = getattr(twin, name, None)
            if inner is not None and hasattr(inner, "__iter__"):
                setattr(twin, name, _seeded_copy(inner, seed, epoch, seeded, depth - 1))
    return twin


@contextmanager
def _global_generators(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator, ``random`` and numpy's with ``seed``; restore them after."""
    numpy = sys.modules.get("numpy")
    saved = (torch.get_rng_state(), random.getstate(), numpy.random.get_state() if numpy else None)
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        if numpy is not None:
            numpy.random.set_state(saved[2])


def draw(sampler: Any, seed: int, epoch: int, *, batches: bool = False) -> list[Any]:
    """``sampler``'s output for ``epoch``: indices, or with ``batches`` lists of indices.

    Example:
        >>> import torch
        >>> weighted = torch.utils.data.WeightedRandomSampler([1.0, 1.0, 5.0], 4)
        >>> draw(weighted, seed=0, epoch=3) == draw(weighted, seed=0, epoch=3)
        True
    """
    seeded: list[bool] = []
    twin = _seeded_copy(sampler, seed, epoch, seeded)
    # A sampler that draws from a generator faccel reseeded needs no global seeding
    # (which costs ~90 us a draw); one that also draws from the global generators is
    # caught by check_repeatable's second draw.
    context = nullcontext() if any(seeded) else _global_generators(seed + epoch)
    with context:
        # The indices are passed on as the sampler yields them, as a DataLoader does.
        return [list(batch) for batch in twin] if batches else list(twin)


def _ints(drawn: list[Any], batches: bool) -> list[Any]:
    """``drawn`` as plain ints (a sampler may yield numpy or tensor scalars), to compare and digest."""
    return [list(map(int, batch)) for batch in drawn] if batches else list(map(int, drawn))


def check_repeatable(sampler: Any, seed: int, *, batches: bool = False) -> list[Any]:
    """Epoch 0's draw, after checking that drawing it again gives the same.

    Raises:
        PrepareError: Two draws of epoch 0 differ: the sampler has hidden state.

    Example:
        >>> import torch
        >>> check_repeatable(torch.utils.data.SubsetRandomSampler([4, 5]), seed=0) in ([4, 5], [5, 4])
        True
    """
    first = _ints(draw(sampler, seed, 0, batches=batches), batches)
    if _ints(draw(sampler, seed, 0, batches=batches), batches) != first:
        msg = (
            f"the {type(sampler).__name__} given to prepare() drew two different orders for the same "
            "epoch and seed: it keeps hidden state (its own random generator, or a counter), so the "
            "ranks would not agree on the order and no position could be resumed exactly. Give it a "
            "`generator` attribute it draws from (faccel reseeds it from (dist.seed, epoch)), or a "
            "`set_epoch(epoch)` method that decides its order; see docs/data.md, 'Custom samplers'"
        )
        raise PrepareError(msg)
    return first
