"""Load balance you can see and steer: the per-step counts, the auxiliary loss, the loss-free bias.

- :func:`expert_load`: each split experts module's load in its last forward
  on this rank (tokens routed to each expert, assignments dropped past the
  capacity), and the same summed over the data-parallel ranks: a dict of plain
  ints, for the loop's logs and any tracker.
- :func:`load_balancing_loss`: the Switch Transformer's auxiliary loss, in
  Mixtral's form (``E * sum_e f_e * P_e``: the fraction of assignments to
  expert ``e`` times its mean router probability), added to the loss by the
  user with a coefficient (transformers' Mixtral computes the same with
  ``output_router_logits=True`` and ``router_aux_loss_coef``).
- :func:`update_expert_bias`: DeepSeek-V3's auxiliary-loss-free balance, one
  step of it: each expert's routing bias moves by ``rate`` toward the mean load
  (up when it got fewer tokens than the mean, down when more). Pure: the new
  bias comes back, to be copied into the router's (DeepSeek-V3's
  ``e_score_correction_bias``), which adds it to the scores used to choose the
  top k only.
"""

from __future__ import annotations

from typing import Any

import torch

from faccel._dist._collectives import reduce
from faccel._dist._state import DistState
from faccel._typecheck import setup_checked

__all__ = ["expert_load", "load_balancing_loss", "update_expert_bias"]


@setup_checked
def expert_load(dist: DistState) -> dict[str, dict[str, Any]]:
    """Each split experts module's load in its last forward: this rank's and the data-parallel ranks'.

    Under expert parallelism (``Layout(expert=...)``), or with ``prepare(...,
    experts=..., expert_capacity=...)`` in one process, every experts module
    counts, in each forward, the tokens its router sent to each expert and the
    assignments dropped past the capacity. A collective where peers exist
    (the counts are summed over the data-parallel ranks): every rank calls it,
    after the same forwards.

    Args:
        dist: The run's :class:`DistState`.

    Returns:
        By experts module name: ``{"routed": [per expert, this rank], "dropped": int,
        "world_routed": [per expert, summed over the data-parallel ranks], "world_dropped": int}``.
        Empty before any forward.

    Example:
        >>> import faccel
        >>> faccel.expert_load(faccel.detect({}))
        {}
    """
    names = sorted(dist.runtime.expert_loads)
    out: dict[str, dict[str, Any]] = {}
    if not names:
        return out
    counts = torch.stack([dist.runtime.expert_loads[n][0].cpu() for n in names]) if names else None
    drops = torch.tensor([dist.runtime.expert_loads[n][1] for n in names], dtype=torch.int64)
    summed = reduce(dist, {"routed": counts, "dropped": drops}, "sum")
    for i, name in enumerate(names):
        out[name] = {
            "routed": [int(c) for c in counts[i]],  # type: ignore[index]
            "dropped": int(drops[i]),
            "world_routed": [int(c) for c in summed["routed"][i]],
            "world_dropped": int(summed["dropped"][i]),
        }
    return out


def load_balancing_loss(
    router_logits: torch.Tensor, top_k_index: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """The auxiliary load-balancing loss of one layer's routing (Switch Transformer; Mixtral's form).

    ``num_experts * sum_e f_e * P_e``, with ``f_e`` the fraction of the
    ``T * k`` assignments routed to expert ``e`` and ``P_e`` the mean over
    tokens of its softmax probability: 1 when the load is even, up to
    ``num_experts`` when every token goes to one expert. Differentiable
    through ``P`` (the router), as in the paper.

    Args:
        router_logits: The router's logits, ``[T, E]``.
        top_k_index: The experts chosen, ``[T, k]``.
        num_experts: ``E``.

    Returns:
        A scalar tensor; add ``coefficient * loss`` to the training loss (Mixtral: 0.02 or 0.001).

    Example:
        >>> import torch
        >>> even = load_balancing_loss(torch.zeros(4, 2), torch.tensor([[0], [1], [0], [1]]), 2)
        >>> first = torch.zeros(4, 1, dtype=torch.long)
        >>> skewed = load_balancing_loss(torch.tensor([[9.0, 0.0]] * 4), first, 2)
        >>> round(float(even), 4), round(float(skewed), 4)
        (1.0, 1.9998)
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    chosen = torch.bincount(top_k_index.reshape(-1), minlength=num_experts).to(probs.dtype)
    fraction = chosen / max(top_k_index.numel(), 1)
    return num_experts * torch.sum(fraction * probs.mean(dim=0))


def update_expert_bias(
    bias: torch.Tensor, routed: torch.Tensor | list[int], *, rate: float = 1e-3
) -> torch.Tensor:
    """One step of DeepSeek-V3's loss-free balance: ``bias + rate * sign(mean load - load)``.

    Pass the load summed over the data-parallel ranks (``expert_load(dist)[name]["world_routed"]``),
    so every rank moves its bias alike.

    Example:
        >>> import torch
        >>> update_expert_bias(torch.zeros(3), [5, 1, 3], rate=0.1)
        tensor([-0.1000,  0.1000,  0.0000])
    """
    load = torch.as_tensor(routed, dtype=bias.dtype, device=bias.device)
    return bias + rate * torch.sign(load.mean() - load)
