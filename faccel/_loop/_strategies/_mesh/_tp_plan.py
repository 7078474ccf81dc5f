"""Tensor parallelism from the user's plan, in PyTorch's own terms, checked before it is applied.

The plan is what ``torch.distributed.tensor.parallel.parallelize_module``
takes: a dict from submodule paths (``fnmatch`` patterns per dotted atom,
``"layers.*.mlp.up"``) to ``ParallelStyle`` objects (``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``...). PyTorch skips a path that
matches no submodule with a warning; here that is an error, because a plan
that silently parallelises nothing trains a model that is not the one asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatch
from typing import Any

from torch import nn

from faccel._dist._mesh import device_mesh
from faccel._dist._state import DistState
from faccel.errors import PrepareError

__all__ = ["apply_plan", "plan_key_matches", "plan_problem"]


def plan_key_matches(pattern: str, name: str) -> bool:
    """Whether a ``tp_plan`` key (``fnmatch`` per dotted atom) names the submodule ``name``.

    Example:
        >>> plan_key_matches("layers.*.mlp", "layers.3.mlp"), plan_key_matches("layers.*", "layers.3.mlp")
        (True, False)
    """
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch(p, a) for p, a in zip(parts, atoms, strict=True))


def plan_problem(model: nn.Module, plan: Mapping[str, Any]) -> str:
    """What is wrong with ``plan`` for ``model``; empty when each key names at least one submodule.

    Example:
        >>> import torch
        >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 2))
        >>> plan_problem(net, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        ''
        >>> plan_problem(net, {"2": ColwiseParallel()})[:44]
        "tp_plan key '2' names no submodule of the Se"
    """
    from torch.distributed.tensor.parallel import ParallelStyle

    names = [name for name, _ in model.named_modules() if name]
    for key, style in plan.items():
        if not isinstance(key, str) or not any(plan_key_matches(key, name) for name in names):
            known = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
            return (
                f"tp_plan key {key!r} names no submodule of the {type(model).__name__} "
                f"(its submodules: {known}); keys are paths as in model.named_modules(), "
                "with * for any one name ('layers.*.mlp.up')"
            )
        if not isinstance(style, ParallelStyle):
            return (
                f"tp_plan[{key!r}] is a {type(style).__name__}, not a ParallelStyle; use PyTorch's "
                "ColwiseParallel(), RowwiseParallel(), SequenceParallel() or your own ParallelStyle"
            )
    return ""


def apply_plan(dist: DistState, model: nn.Module, plan: Mapping[str, Any] | None) -> None:
    """Shard ``model``'s layers over the ``"tensor"`` dimension of the mesh, in place, as ``plan`` says.

    Raises:
        PrepareError: The layout has tensor parallelism and no plan was given, or
            the plan names no submodule or holds something other than a ParallelStyle.
    """
    if plan is None:
        msg = (
            f"the layout {dist.parallel} splits each layer over {dist.parallel.tensor} ranks, "
            "but prepare() got no tp_plan saying how; pass tp_plan={'path.to.linear': "
            "ColwiseParallel(), ...} (docs/parallelism.md has one for a transformer block)"
        )
        raise PrepareError(msg)
    problem = plan_problem(model, plan)
    if problem:
        raise PrepareError(problem)
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, device_mesh(dist)["tensor"], dict(plan))
