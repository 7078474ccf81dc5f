"""Context parallelism in the loop: the devices that run it, attention through torch's ``context_parallel``.

A layout with ``context > 1`` splits every sequence over the context ranks
(``faccel.context_shard`` gives each its head-tail slice); attention must then
see every rank's keys and values, which torch's ``context_parallel`` does
(ring attention over the ``"context"`` dimension of the mesh, replacing
``scaled_dot_product_attention`` inside the ``with`` block). torch registers
that only for its CUDA attention kernels (flash, memory-efficient, cuDNN):
on the CPU it stops with "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
sharding strategy registered". So faccel refuses such a layout at
``prepare`` on any other device, by name, before a step runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from faccel._dist._state import DistState
from faccel.errors import PrepareError

__all__ = ["CONTEXT_DEVICES", "context_attention", "context_problem"]

#: Device types on which torch's ``context_parallel`` has sharding rules for attention.
CONTEXT_DEVICES: tuple[str, ...] = ("cuda",)


def context_problem(dist: DistState) -> str:
    """Why ``dist``'s layout cannot run context parallelism on its device; empty if it can (or context is 1).

    Example:
        >>> import faccel
        >>> dist = faccel.DistState.simulated(world_size=2, layout=faccel.Layout(context=2))
        >>> context_problem(dist)[:60]
        'layout replicate=1,shard=1,context=2,tensor=1 asks for 2 con'
        >>> context_problem(faccel.DistState.simulated(world_size=2, strategy="fsdp"))
        ''
    """
    layout = dist.parallel
    if layout.context == 1 or dist.device.type in CONTEXT_DEVICES:
        return ""
    return (
        f"layout {layout} asks for {layout.context} context-parallel ranks, but torch's "
        f"context_parallel (ring attention) has no attention kernel on device {dist.device.type!r}: "
        f"it runs on {', '.join(repr(d) for d in CONTEXT_DEVICES)} only (on the CPU torch stops with "
        "'aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy "
        "registered'). Run on CUDA GPUs, or fold the context ranks into another dimension "
        f"(e.g. shard={layout.shard * layout.context})"
    )


def check_context(dist: DistState) -> None:
    """Refuse a context-parallel layout on a device torch cannot run it on.

    Raises:
        PrepareError: ``context > 1`` on a device outside :data:`CONTEXT_DEVICES`.
    """
    problem = context_problem(dist)
    if problem:
        raise PrepareError(problem)


@contextlib.contextmanager
def context_attention(dist: DistState) -> Iterator[None]:
    """Attention over every context rank's keys and values inside the ``with`` block (CUDA only).

    Put the forward (and, under it, the backward) of a step inside it, on a
    batch sliced by :func:`faccel.context_shard` for this rank. It is torch's
    ``context_parallel`` over the mesh's ``"context"`` dimension with no
    buffers of its own: faccel has sliced the batch already, head-tail, the
    layout torch's load balancer expects. With ``context == 1`` it does nothing,
    so the same loop runs at every layout.

    Raises:
        PrepareError: ``context > 1`` on a device torch cannot run it on.

    Example:
        >>> import faccel
        >>> with faccel.context_attention(faccel.detect({})):  # context 1: nothing to split
        ...     pass
    """
    if dist.parallel.context == 1:
        yield
        return
    check_context(dist)
    from torch.distributed.tensor.experimental import context_parallel

    from faccel._dist._mesh import device_mesh

    with context_parallel(device_mesh(dist)["context"], buffers=[], buffer_seq_dims=[]):
        yield
