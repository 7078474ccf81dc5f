"""The evaluation check-in of a sharded model: the ranks meet when its forwards change kind.

A model sharded over processes (FSDP2, or tensor parallelism) gathers its
parameters from every rank in every forward. A forward on some ranks only
(evaluation under ``if dist.is_main_process``, nanoGPT's ``estimate_loss``)
pairs its all-gathers with whatever the other ranks do next: a hang, gloo's
abort (``EnforceNotMet ... preamble.length``), or all-gathers of equal shapes
that pair silently. Evaluation is where that mistake is made.

Why at the changes of kind, and only there. The mistake shows where the
ranks' sequences of forwards part: one rank starts evaluating while another
trains on, or one rank evaluates more batches than another and the others
are already training. Both are a change of kind (with gradients <-> without)
on some ranks and not on others. So each rank checks in (a
``monitored_barrier`` on a gloo group of faccel's own, bounded by the
timeout) at its first forward without gradients after one with them (or the
first forward at all), and at its first forward with gradients after one
without. A rank that is missing makes the others' check-in fail after the
timeout with a :class:`~faccel.errors.DistributedError` naming the mistake,
where today's gloo would hang or abort. Forwards in a row of one kind (a
whole evaluation, generation token by token, training) pay one comparison of
two bools and no collective: steady-state evaluation costs what the hand-written
``fully_shard`` model costs (benchmarks/bench_eval_forward.py). What this cannot
see: ranks that both evaluate, but a different number of forwards each, with
no training forward after (the job then ends in the collective that follows).

The hook and the group live in ``dist.runtime`` (``faccel._marks`` lists
them) and :func:`faccel.shutdown` removes them.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn

from faccel._dist._process_group import breadcrumb
from faccel._dist._state import DistState
from faccel._marks import CHECK_IN_GROUP
from faccel.errors import DistributedError

__all__ = ["CheckIn", "add_check_in"]


@attrs.define
class CheckIn:
    """One sharded model's check-in state: the kind of its last forward, and how the model is sharded.

    Attributes:
        sharding: How the model is spread (``'FSDP2'``, ``'tensor-parallel'``), for the message.
        grad: Whether the last forward ran with gradients (True before any, so
            that a first forward without gradients checks in).
    """

    sharding: str
    grad: bool = True


def add_check_in(dist: DistState, model: nn.Module, *, sharding: str) -> CheckIn:
    """Register the check-in on ``model`` (a forward pre-hook, first in line), held by ``dist.runtime``.

    Every rank calls it for the same models in the same order (it is part of
    ``prepare``): the first call of a runtime makes the gloo group, a collective.
    """
    import torch.distributed as tdist

    group = dist.runtime.group(CHECK_IN_GROUP, lambda: tdist.new_group(backend="gloo", timeout=dist.timeout))
    state = CheckIn(sharding=sharding)

    def check_in(module: nn.Module, args: Any) -> None:
        grad = torch.is_grad_enabled()
        if grad is not state.grad:  # a change of kind: the only forwards that meet
            _meet(dist, module, group, state, grad=grad)

    dist.runtime.hold(model.register_forward_pre_hook(check_in, prepend=True))
    return state


@torch.compiler.disable
def _meet(dist: DistState, module: nn.Module, group: Any, state: CheckIn, *, grad: bool) -> None:
    import torch.distributed as tdist

    timeout = dist.runtime.timeout or dist.timeout  # the train_timeout, once warmed up
    kind = "with" if grad else "without"
    breadcrumb(dist, f"forward {kind} gradients", collective=True)
    try:
        tdist.monitored_barrier(group=group, timeout=timeout)
    except RuntimeError as error:
        name = type(module).__name__
        if state.sharding == "FSDP2":
            name = name.removeprefix("FSDP")  # FSDP2 names its classes FSDP<yours>
        if grad:
            waited = (
                "for the other ranks to end their forwards without gradients too, and they did not: "
                "some rank ran more forwards without gradients (evaluation batches) than this one"
            )
        else:
            waited = "for the other ranks to run one too, and they did not"
        msg = (
            f"a forward of the sharded ({state.sharding}) {name} {kind} gradients on rank {dist.rank} "
            f"of {dist.world_size} waited {timeout} {waited}: a sharded model gathers its parameters "
            "from every rank in every forward, so every rank must run every forward, evaluation "
            "included. Evaluate on every rank (each on its part of the data, the same number of "
            "batches: prepare the evaluation loader with even_batches=True, the default; combine "
            "with faccel.reduce or faccel.gather_for_metrics) and print on the main process only. "
            f"torch said: {error}"
        )
        raise DistributedError(msg) from error
    state.grad = grad
