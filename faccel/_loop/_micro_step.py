"""The accumulation boundary: which micro-step of an epoch syncs, as a pure function of plain integers.

Micro-step ``i`` of an epoch with ``n`` batches and ``k`` accumulation steps
belongs to group ``i // k``; the group syncs (all-reduces and steps) at its
last micro-step, and its losses are divided by the group's real size, so the
last, partial group of an epoch is weighted correctly. This module imports
nothing that starts processes (``tests/test_import_graph.py``); the loop's
side (the loader walk, the no-sync contexts) is in ``_accumulate``.
"""

# No ``from __future__ import annotations``: the fields' types stay objects, so a runtime
# checker (typeguard, in the tests) resolves ``Atom`` from any module that checks a MicroStep.
from typing import Any, NamedTuple

from faccel.errors import AccumulationError

__all__ = ["Atom", "MicroStep", "micro_step", "sync_boundary"]


class Atom(NamedTuple):
    """Which atom a micro-step of exact mode computes (``micro.atom``; docs/exact.md).

    Attributes:
        index: The atom, in ``[0, atoms)``: the global positions ``p`` of the
            batch with ``p % atoms == index``.
        piece: Which batch of the accumulation group this piece is from.
        last: Whether it is the atom's last piece (its gradient is then whole).
        seed: The seed torch's generators run under for this piece; derive
            Python or NumPy randomness of the forward from it
            (``numpy.random.default_rng(micro.atom.seed)``).
        group: The step's live accumulator (``faccel._loop._exact._mode.AtomGroup``);
            ``group.loss`` is the step's loss, the same bits at every size,
            once the step's last piece went through ``faccel.backward``.

    Example:
        >>> Atom(index=3, piece=0, last=True, seed=7, group=None).index
        3
    """

    index: int  # type: ignore[assignment]  # shadows tuple.index, as MicroStep's does
    piece: int
    last: bool
    seed: int
    group: Any  # an AtomGroup (faccel._loop._exact._mode imports this module, not the reverse)


class MicroStep(NamedTuple):
    """Where a micro-batch sits in its accumulation group.

    A named tuple rather than an attrs record: one is made per micro-batch in
    the training loop, and a frozen attrs instance measured ~1.5% of a small
    model's micro-step (a named tuple: within noise of none).

    Attributes:
        index: The micro-step's index in the epoch (batches consumed before it).
        sync: Whether this micro-step ends its group: gradients are all-reduced
            and the optimizer steps after it.
        group_size: Micro-steps in this group (its losses are divided by it).
        items: The items (tokens, samples) of the whole group on every
            data-parallel rank, counted by ``micro_batches(..., items=count)``
            before the group starts; None when not counted. ``backward(...,
            items=n)`` divides the loss sum by it instead of by ``group_size``.
        atom: In exact mode (``micro_batches(..., atoms=A, model=model)``), which
            atom of the step this micro-step computes (``faccel._loop._micro_step.Atom``:
            its index, seed and the step's accumulator); None otherwise.

    Example:
        >>> micro_step(9, accumulation_steps=4, num_batches=10)
        MicroStep(index=9, sync=True, group_size=2, items=None, atom=None)
    """

    # Shadows tuple.index (a method nobody calls on a MicroStep): the name reads best.
    index: int  # type: ignore[assignment]
    sync: bool
    group_size: int
    items: int | None = None
    atom: Atom | None = None


def micro_step(index: int, *, accumulation_steps: int, num_batches: int | None) -> MicroStep:
    """The :class:`MicroStep` of micro-batch ``index``. Pure.

    Args:
        index: Batches consumed in the epoch before this one.
        accumulation_steps: Micro-batches per optimizer step.
        num_batches: Batches in the epoch; None when unknown (then every group
            is taken as full and the caller must say when the data ends).

    Raises:
        AccumulationError: ``index`` outside ``[0, num_batches)`` or steps < 1.

    Example:
        >>> [micro_step(i, accumulation_steps=2, num_batches=5).sync for i in range(5)]
        [False, True, False, True, True]
    """
    if accumulation_steps < 1:
        msg = f"accumulation_steps must be >= 1, got {accumulation_steps!r}"
        raise AccumulationError(msg)
    if index < 0 or (num_batches is not None and index >= num_batches):
        msg = f"micro-step index must be in [0, {num_batches}), got {index!r}"
        raise AccumulationError(msg)
    return sync_boundary(index, accumulation_steps, num_batches)


def sync_boundary(index: int, k: int, num_batches: int | None) -> MicroStep:
    """The boundary itself, for arguments already known to be valid (the hot loop)."""
    first = index - index % k
    end = first + k if num_batches is None else min(first + k, num_batches)
    return MicroStep(index=index, sync=index == end - 1, group_size=end - first)
