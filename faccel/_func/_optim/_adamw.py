"""Pure AdamW over pytrees, as ``torch.optim.AdamW`` computes it (its single-tensor path).

The arithmetic is torch.optim's own (its single-tensor path, the default on
CPU), operation for operation, so results match ``torch.optim.AdamW`` (and
``_sgd`` ``torch.optim.SGD``) to rounding, in practice bit for bit.

The step of both is a static Python ``int`` (kept out of the leaves, see
:func:`faccel.func.static_field`), not a 0-d tensor: torch.optim itself turns
its step tensor into a Python number (``.item()``) and computes the bias
corrections in double precision, which a float32 tensor step cannot match to
1e-6 at small steps (``1 - 0.999**1`` loses four digits). An ``int`` also costs
no device sync on a GPU and is plain JSON in a checkpoint, where a 0-d step
tensor saved through ``torch.distributed.checkpoint`` was seen to come back as
0.0. The price: states at different steps have different tree structures, so
``tree_map`` across two of them fails, and ``torch.compile`` sees a changing
int (one recompile, then it is treated as dynamic).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from faccel._func._optim._base import check, leaves_like, zeros_like
from faccel._tree import flatten, register_pytree, static_field, unflatten
from faccel._typecheck import setup_checked
from faccel.errors import FunctionalError

__all__ = ["AdamW", "AdamWState", "adamw"]


@register_pytree
@attrs.frozen(kw_only=True)
class AdamWState:
    """State of :func:`faccel.func.adamw`: first and second moments (and their maximum for AMSGrad).

    Attributes:
        exp_avg: The gradients' running average, a tree like params.
        exp_avg_sq: The squared gradients' running average, a tree like params.
        max_exp_avg_sq: Its running maximum with ``amsgrad``, else ``None``.
        step: Updates applied so far (static: not a leaf).

    Example:
        >>> import torch, faccel
        >>> state = faccel.func.adamw(amsgrad=True).init({"w": torch.ones(2)})
        >>> state.step, sorted(state.max_exp_avg_sq)
        (0, ['w'])
    """

    exp_avg: Any
    exp_avg_sq: Any
    max_exp_avg_sq: Any = None
    step: int = static_field(default=0)


@attrs.frozen(kw_only=True)
class AdamW:
    """Hyperparameters of pure AdamW, with ``init`` and ``update``; made by :func:`faccel.func.adamw`."""

    lr: float = attrs.field(default=1e-3, converter=float)
    betas: tuple[float, float] = attrs.field(
        default=(0.9, 0.999), converter=lambda b: (float(b[0]), float(b[1]))
    )
    eps: float = attrs.field(default=1e-8, converter=float)
    weight_decay: float = attrs.field(default=1e-2, converter=float)
    amsgrad: bool = False
    maximize: bool = False

    def __attrs_post_init__(self) -> None:
        check(self.lr >= 0.0, f"lr must be >= 0, got {self.lr!r}")
        check(self.eps >= 0.0, f"eps must be >= 0, got {self.eps!r}")
        check(all(0.0 <= b < 1.0 for b in self.betas), f"betas must be in [0, 1), got {self.betas!r}")
        check(self.weight_decay >= 0.0, f"weight_decay must be >= 0, got {self.weight_decay!r}")

    def init(self, params: Any) -> AdamWState:
        """The state before the first update: zero moments shaped like ``params``.

        Example:
            >>> import torch, faccel
            >>> state = faccel.func.adamw().init({"w": torch.ones(2)})
            >>> state.exp_avg["w"].tolist(), state.max_exp_avg_sq
            ([0.0, 0.0], None)
        """
        leaves, spec = flatten(params)
        return AdamWState(
            exp_avg=zeros_like(leaves, spec),
            exp_avg_sq=zeros_like(leaves, spec),
            max_exp_avg_sq=zeros_like(leaves, spec) if self.amsgrad else None,
        )

    def update(
        self, grads: Any, state: AdamWState, params: Any, *, lr: float | None = None
    ) -> tuple[Any, AdamWState]:
        """One AdamW step: ``(new_params, new_state)``, as :meth:`faccel.func.Optimizer.update`.

        torch.optim.AdamW's formulas: decoupled weight decay ``p * (1 - lr *
        weight_decay)`` first, bias corrections in double precision, ``eps``
        added after dividing ``sqrt(v)`` by ``sqrt(1 - beta2**t)``.

        Raises:
            FunctionalError: The trees' structures differ, or ``state`` is not
                an :class:`AdamWState` of this configuration.

        Example:
            >>> import torch, faccel
            >>> opt = faccel.func.adamw(lr=0.1, weight_decay=0.0)
            >>> params = {"w": torch.zeros(2)}
            >>> params, state = opt.update({"w": torch.tensor([1.0, -1.0])}, opt.init(params), params)
            >>> [round(x, 4) for x in params["w"].tolist()], state.step
            ([-0.1, 0.1], 1)
        """
        if not isinstance(state, AdamWState) or (state.max_exp_avg_sq is None) == self.amsgrad:
            msg = (
                f"update() needs the AdamWState made by init() of this optimizer (amsgrad="
                f"{self.amsgrad}), got {type(state).__name__}; call opt.init(params) first"
            )
            raise FunctionalError(msg)
        rate = self.lr if lr is None else lr
        beta1, beta2 = self.betas
        eps, wd = self.eps, self.weight_decay
        step = state.step + 1
        # Python floats (double), as torch.optim's default path computes them.
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        step_size = rate / bias_correction1
        p_leaves, spec = flatten(params)
        g_leaves = leaves_like(grads, params, spec, "grads")
        m_leaves = leaves_like(state.exp_avg, params, spec, "state.exp_avg")
        v_leaves = leaves_like(state.exp_avg_sq, params, spec, "state.exp_avg_sq")
        vmax_leaves = (
            leaves_like(state.max_exp_avg_sq, params, spec, "state.max_exp_avg_sq") if self.amsgrad else []
        )
        new_p, new_m, new_v, new_vmax = [], [], [], []
        with torch.no_grad():
            for i, (p, g, m, v) in enumerate(zip(p_leaves, g_leaves, m_leaves, v_leaves, strict=True)):
                g = -g if self.maximize else g
                if wd != 0.0:
                    p = p.mul(1 - rate * wd)
                m = m.lerp(g, 1 - beta1)
                v = v.mul(beta2).addcmul_(g, g, value=1 - beta2)
                if self.amsgrad:
                    vmax = torch.maximum(vmax_leaves[i], v)
                    new_vmax.append(vmax)
                    denom = (vmax.sqrt() / bias_correction2_sqrt).add_(eps)
                else:
                    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
                new_p.append(p.addcdiv(m, denom, value=-step_size))
                new_m.append(m)
                new_v.append(v)
        return unflatten(new_p, spec), AdamWState(
            exp_avg=unflatten(new_m, spec),
            exp_avg_sq=unflatten(new_v, spec),
            max_exp_avg_sq=unflatten(new_vmax, spec) if self.amsgrad else None,
            step=step,
        )


@setup_checked
def adamw(
    lr: float = 1e-3,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
) -> AdamW:
    """Pure AdamW over pytrees, as ``torch.optim.AdamW`` computes it (same defaults).

    ``init(params)`` gives an :class:`AdamWState`; ``update(grads, state,
    params, *, lr=None)`` gives ``(new_params, new_state)``.

    Args:
        lr: Learning rate.
        betas: Decay rates of the first and second moment averages.
        eps: Added to the denominator, after the bias correction.
        weight_decay: Decoupled weight decay: parameters shrink by ``lr * weight_decay``.
        amsgrad: Normalise by the running maximum of the second moment.
        maximize: Ascend instead of descend.

    Returns:
        The optimizer (a frozen record).

    Raises:
        ArgumentValueError: A hyperparameter out of range.

    Example:
        >>> import torch, faccel
        >>> opt = faccel.func.adamw(lr=1e-2)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> for _ in range(3):
        ...     params, state = opt.update({"w": params["w"] * 2}, state, params)
        >>> state.step, params["w"][0].item() < 1.0
        (3, True)
    """
    return AdamW(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
