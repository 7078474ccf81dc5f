"""What the tests of a peer dying during a checkpoint's whole-state gather run on every rank.

Rank 1 ends its process (``os._exit``, no cleanup, as a kill would) at the moment it would
gather: at the entry of the function that gathers (torch's ``get_state_dict`` for FSDP2,
DeepSpeed's ``safe_get_full_optimizer_state`` for ZeRO-1/2), which the survivor has already
entered. Rank 0 returns what the user sees: the error's type and message.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from tests.distributed.peer_workers import _outcome


def _die(*args: Any, **kwargs: Any) -> Any:
    os._exit(0)


def peer_dies_in_the_gather(root: str, strategy: str, timeout_s: float, stage: int = 2) -> dict[str, Any]:
    """Both ranks trained one step; rank 1 dies entering the gather of ``checkpoint(..., sharded=False)``."""
    import attrs

    import faccel

    timeout = datetime.timedelta(seconds=timeout_s)
    if strategy == "deepspeed":
        from tests.distributed import deepspeed_workers as dw

        os.environ["DS_ACCELERATOR"] = "cpu"
        dist = faccel.detect(strategy="deepspeed", deepspeed=dw._zero(stage), timeout=timeout)
        objects = dw._prepared(dist)
        state = dw._train(dist, objects, objects[4], until=1, root=root)
        if dist.rank == 1:
            import deepspeed.utils

            deepspeed.utils.safe_get_full_optimizer_state = _die  # type: ignore[assignment]
    else:
        from tests.distributed.sharded_workers import _trained

        dist = faccel.detect(strategy=strategy, timeout=timeout)
        model, optimizer = _trained(dist, 1)
        state = attrs.evolve(faccel.TrainState.create(model=model, optimizer=optimizer), step=1)
        if dist.rank == 1:
            import torch.distributed.checkpoint.state_dict as state_dict

            state_dict.get_state_dict = _die  # type: ignore[assignment]
    torch.manual_seed(0)
    return _outcome(lambda: faccel.checkpoint(dist, state, root, sharded=False))
