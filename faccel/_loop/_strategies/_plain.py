"""One process (and the table's last row): the model moved and, under mixed precision, autocast.

Nothing is wrapped for peers: there are none. The FSDP2 options are accepted where the run's
strategy would shard at a larger size, so one script runs at every size (``LoopStrategy.check_options``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from faccel._dist._state import DistState
from faccel._loop._strategies._base import LoopStrategy

__all__ = ["PlainStrategy"]


class PlainStrategy(LoopStrategy):
    """One process: every question answered as the floor answers it; holds every model the others do not.

    Example:
        >>> import torch, faccel
        >>> PlainStrategy().applies(faccel.DistState()), PlainStrategy().holds(torch.nn.Linear(1, 1))
        (True, True)
    """

    name = "plain"

    def applies(self, dist: DistState) -> bool:
        """Every run the rows above did not take (one process, or a simulated one)."""
        return True

    def holds(self, model: object, params: Sequence[torch.Tensor] = ()) -> bool:
        """Every model the rows above did not take."""
        return True
