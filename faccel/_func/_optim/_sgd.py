"""Pure SGD over pytrees, as ``torch.optim.SGD`` computes it (its single-tensor path).

The step is a static Python ``int``, which lets the first step (the momentum
buffer starts at the first gradient, undamped) branch in Python; see
``faccel._func._optim._adamw`` for why the step is an ``int``.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from faccel._func._optim._base import check, leaves_like, zeros_like
from faccel._tree import flatten, register_pytree, static_field, unflatten
from faccel._typecheck import setup_checked
from faccel.errors import FunctionalError

__all__ = ["SGD", "SGDState", "sgd"]


@register_pytree
@attrs.frozen(kw_only=True)
class SGDState:
    """State of :func:`faccel.func.sgd`: the momentum buffers (``None`` without momentum) and the step.

    Attributes:
        momentum_buffer: A tree like params, or ``None`` when ``momentum == 0``.
        step: Updates applied so far (static: not a leaf).

    Example:
        >>> import torch, faccel
        >>> state = faccel.func.sgd(0.1, momentum=0.9).init({"w": torch.ones(2)})
        >>> state.step, state.momentum_buffer["w"].tolist()
        (0, [0.0, 0.0])
    """

    momentum_buffer: Any = None
    step: int = static_field(default=0)


@attrs.frozen(kw_only=True)
class SGD:
    """Hyperparameters of pure SGD, with ``init`` and ``update``; made by :func:`faccel.func.sgd`."""

    lr: float = attrs.field(converter=float)
    momentum: float = attrs.field(default=0.0, converter=float)
    dampening: float = attrs.field(default=0.0, converter=float)
    weight_decay: float = attrs.field(default=0.0, converter=float)
    nesterov: bool = False
    maximize: bool = False

    def __attrs_post_init__(self) -> None:
        check(self.lr >= 0.0, f"lr must be >= 0, got {self.lr!r}")
        check(self.momentum >= 0.0, f"momentum must be >= 0, got {self.momentum!r}")
        check(self.weight_decay >= 0.0, f"weight_decay must be >= 0, got {self.weight_decay!r}")
        check(
            not self.nesterov or (self.momentum > 0.0 and self.dampening == 0.0),
            f"nesterov needs momentum > 0 and dampening == 0, got momentum={self.momentum!r}, "
            f"dampening={self.dampening!r}",
        )

    def init(self, params: Any) -> SGDState:
        """The state before the first update: zero momentum buffers shaped like ``params``.

        Example:
            >>> import torch, faccel
            >>> faccel.func.sgd(0.1).init({"w": torch.ones(2)})
            SGDState(momentum_buffer=None, step=0)
        """
        if self.momentum == 0.0:
            return SGDState()
        leaves, spec = flatten(params)
        return SGDState(momentum_buffer=zeros_like(leaves, spec))

    def update(
        self, grads: Any, state: SGDState, params: Any, *, lr: float | None = None
    ) -> tuple[Any, SGDState]:
        """One SGD step: ``(new_params, new_state)``, as :meth:`faccel.func.Optimizer.update`.

        Raises:
            FunctionalError: The trees' structures differ, or ``state`` is not
                an :class:`SGDState` of this configuration.

        Example:
            >>> import torch, faccel
            >>> opt = faccel.func.sgd(0.5)
            >>> params = {"w": torch.ones(2)}
            >>> params, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
            >>> params["w"].tolist(), state.step
            ([0.5, 0.5], 1)
        """
        if not isinstance(state, SGDState) or (state.momentum_buffer is None) != (self.momentum == 0.0):
            msg = (
                f"update() needs the SGDState made by init() of this optimizer (momentum="
                f"{self.momentum}), got {type(state).__name__}; call opt.init(params) first"
            )
            raise FunctionalError(msg)
        rate = self.lr if lr is None else lr
        momentum, wd = self.momentum, self.weight_decay
        p_leaves, spec = flatten(params)
        g_leaves = leaves_like(grads, params, spec, "grads")
        first = state.step == 0
        new_p: list[torch.Tensor] = []
        with torch.no_grad():
            if momentum == 0.0:
                for p, g in zip(p_leaves, g_leaves, strict=True):
                    g = -g if self.maximize else g
                    if wd != 0.0:
                        g = g.add(p, alpha=wd)
                    new_p.append(p.add(g, alpha=-rate))
                return unflatten(new_p, spec), SGDState(step=state.step + 1)
            bufs = leaves_like(state.momentum_buffer, params, spec, "state.momentum_buffer")
            new_b: list[torch.Tensor] = []
            for p, g, b in zip(p_leaves, g_leaves, bufs, strict=True):
                g = -g if self.maximize else g
                if wd != 0.0:
                    g = g.add(p, alpha=wd)
                # torch.optim starts the buffer at the first gradient, undamped.
                b = g.clone() if first else b.mul(momentum).add_(g, alpha=1.0 - self.dampening)
                g = g.add(b, alpha=momentum) if self.nesterov else b
                new_p.append(p.add(g, alpha=-rate))
                new_b.append(b)
        return unflatten(new_p, spec), SGDState(momentum_buffer=unflatten(new_b, spec), step=state.step + 1)


@setup_checked
def sgd(
    lr: float,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
) -> SGD:
    """Pure SGD over pytrees, as ``torch.optim.SGD`` computes it.

    ``init(params)`` gives an :class:`SGDState`; ``update(grads, state,
    params, *, lr=None)`` gives ``(new_params, new_state)``. The record is
    frozen and hashable: a :func:`faccel.func.static_field` of a state can hold it.

    Args:
        lr: Learning rate.
        momentum: Momentum factor (0: plain SGD, no buffers).
        dampening: Dampening of the momentum.
        weight_decay: L2 penalty added to the gradient.
        nesterov: Nesterov momentum.
        maximize: Ascend instead of descend.

    Returns:
        The optimizer (a frozen record).

    Raises:
        ArgumentValueError: A hyperparameter out of range (as torch.optim's checks).

    Example:
        >>> import torch, faccel
        >>> opt = faccel.func.sgd(0.1, momentum=0.9, nesterov=True)
        >>> params = {"w": torch.ones(3)}
        >>> state = opt.init(params)
        >>> params, state = opt.update({"w": torch.ones(3)}, state, params)
        >>> [round(x, 4) for x in params["w"].tolist()]
        [0.81, 0.81, 0.81]
    """
    return SGD(
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        maximize=maximize,
    )
