"""DDP: every rank holds the whole model, as one process does; the wrapper is taken off.

The same state as :class:`~faccel._checkpoint._strategies._plain.PlainState` (rank 0 writes the
whole tensors, every rank loads them through ``load_state_dict``), its own row so that the
table names every strategy faccel prepares.
"""

from __future__ import annotations

from faccel._checkpoint._strategies._plain import PlainState

__all__ = ["DDPState"]


class DDPState(PlainState):
    """The strategy state of a DDP-wrapped model."""

    name = "ddp"

    def holds(self, model: object) -> bool:
        """A ``DistributedDataParallel`` wrapper."""
        from torch.nn.parallel import DistributedDataParallel

        return isinstance(model, DistributedDataParallel)
