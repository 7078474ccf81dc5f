"""Seeding the global random generators of Python, NumPy and torch."""

from __future__ import annotations

import random

import torch

from faccel._dist._state import DistState
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentValueError

__all__ = ["set_seed"]


@setup_checked
def set_seed(dist: DistState, seed: int, *, per_rank: bool = False) -> int:
    """Seed Python's ``random``, NumPy's global generator and torch (CPU and every accelerator).

    This changes process-wide state: the global generators that ``random.random()``,
    ``numpy.random.rand()`` and ``torch.randn()`` draw from (``torch.manual_seed``
    also seeds every CUDA, MPS and XPU device).

    It does **not** change the data order (a plain ``DataLoader`` shuffles from
    torch's global generator; a prepared one does not): a prepared loader's shuffle
    follows ``dist.seed`` and the epoch (see :class:`faccel.Sharding`); for
    another order, ``faccel.detect(seed=...)``.

    Args:
        dist: This process's state.
        seed: The seed, in ``[0, 2**32)`` (NumPy's range).
        per_rank: Seed with ``seed + dist.data_rank``, so that ranks draw different
            numbers (e.g. dropout masks or augmentations that should differ per
            rank). By default every rank draws the same numbers (e.g. for
            identical initial weights). The data-parallel rank, not the rank:
            under tensor parallelism the ranks of one tensor-parallel group
            compute on one batch together and must draw the same noise (without
            a layout the two are the same).

    Returns:
        The seed used.

    Raises:
        ArgumentValueError: The seed (plus the rank) is outside ``[0, 2**32)``.

    Example:
        >>> import torch, faccel
        >>> dist = faccel.DistState.simulated(rank=3, world_size=4)
        >>> set_seed(dist, 7, per_rank=True)
        10
        >>> a = torch.rand(2); _ = set_seed(dist, 7, per_rank=True); torch.equal(a, torch.rand(2))
        True
        >>> layout = faccel.Layout(shard=2, tensor=2)
        >>> tensor_parallel = faccel.DistState.simulated(rank=3, world_size=4, layout=layout)
        >>> set_seed(tensor_parallel, 7, per_rank=True)   # rank 3 reads data-parallel share 1
        8
    """
    value = seed + dist.data_rank if per_rank else seed
    if not 0 <= value < 2**32:
        shown = f"seed + rank = {seed} + {dist.data_rank}" if per_rank else f"seed {seed}"
        msg = f"the seed must be in [0, 2**32) (NumPy's range), got {shown} = {value}; pick a smaller seed"
        raise ArgumentValueError(msg)
    import numpy  # torch imports it already; imported here so faccel's own import stays lean

    random.seed(value)
    numpy.random.seed(value)
    torch.manual_seed(value)  # every CUDA/MPS/XPU device as well, lazily if not yet initialised
    return value
