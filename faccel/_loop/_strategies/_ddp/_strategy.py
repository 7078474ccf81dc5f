"""DDP's loop strategy: every rank a whole replica, gradients all-reduced in buckets during the backward.

``DDPStrategy`` wraps the model (over an autocast layer where precision asks for it), fixes the
bucket layout, pins the wrapper's process group and registers a communication hook if asked;
``uneven_inputs`` joins it. Beside it: its communication hooks (``_comm_hooks``) and LocalSGD
(``_local_sgd``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from faccel._dist._process_group import pin_process_group
from faccel._dist._state import DistState
from faccel._loop._options import PrepareOptions
from faccel._loop._strategies._base import LoopStrategy
from faccel._loop._strategies._ddp._comm_hooks import register_comm_hook
from faccel._loop._strategies._experts._dispatch import ignore_experts_in_ddp
from faccel._torch_compat import rebuild_ddp_buckets
from faccel.errors import PrepareError

__all__ = ["DDPStrategy"]


class DDPStrategy(LoopStrategy):
    """``strategy='ddp'`` over peer processes (the table's row after the sharding ones).

    Example:
        >>> import faccel
        >>> DDPStrategy().applies(faccel.DistState.simulated(world_size=2))  # simulated: no peers
        False
    """

    name = "ddp"

    def applies(self, dist: DistState) -> bool:
        """Peer processes that no row above took: DDP (``strategy='ddp'``, a layout of replicas only)."""
        return dist.distributed

    def holds(self, model: object, params: Sequence[torch.Tensor] = ()) -> bool:
        """A ``DistributedDataParallel`` wrapper."""
        return isinstance(model, DistributedDataParallel)

    def prepare_model(self, dist: DistState, model: nn.Module, options: PrepareOptions) -> nn.Module:
        """Moved and wrapped as the floor does, then the communication hook asked for registered."""
        prepared = super().prepare_model(dist, model, options)
        if options.comm_hook is not None:
            register_comm_hook(dist, prepared, options.comm_hook, options.comm_hook_options)
        return prepared

    def wrap(self, dist: DistState, model: nn.Module, options: PrepareOptions) -> nn.Module:
        """Autocast (where asked), then ``DistributedDataParallel`` with a fixed bucket layout."""
        wrapped = super().wrap(dist, model, options)
        if not any(param.requires_grad for param in model.parameters()):
            msg = (
                f"the {type(model).__name__} has no parameter that requires a gradient, so DDP has "
                "nothing to train or average (torch's DistributedDataParallel refuses it); prepare the "
                "model that trains, and build one of buffers only on dist.device, unprepared"
            )
            raise PrepareError(msg)
        device_ids = [dist.device.index] if dist.device.type == "cuda" else None
        ignore_experts_in_ddp(wrapped)  # each rank's own experts (faccel._loop._strategies._experts)
        ddp = DistributedDataParallel(wrapped, device_ids=device_ids, **dict(options.ddp_kwargs or {}))
        if dist.world_size > 2:
            _fix_bucket_layout(ddp)
        pin_process_group(ddp)  # freeing it after shutdown must not join gloo's threads (faccel._marks)
        return ddp

    def unwrap(self, model: object) -> nn.Module | None:
        """The module inside a DDP wrapper."""
        return model.module if isinstance(model, DistributedDataParallel) else None

    def uneven_problem(self, model: object) -> str | None:
        """None: DDP's ``Join`` shadows a finished rank's all-reduces."""
        return None


def _fix_bucket_layout(ddp: DistributedDataParallel) -> None:
    """Give ``ddp`` the gradient buckets it reduces in from its first step on.

    DDP reduces its first step in one bucket of every parameter, then rebuilds
    its buckets in the order gradients became ready. An all-reduce over more
    than two ranks sums each element in an order that depends on where the
    element lies in its bucket, so a freshly built DDP (a resumed job) would
    reduce its first step differently from a job that has been running: the
    weights part in the last bits. Rebuilding here, in parameter order, fixes
    the layout for every step of every job. (With two ranks each element is
    ``a + b`` whatever the layout, so DDP's own bucketing is kept there.)
    Both calls are collectives that every rank makes, as DDP's constructor is.
    A DDP that never rebuilds (``find_unused_parameters=True``) is left as it is.
    """
    rebuild_ddp_buckets(ddp)
