"""The experts of a model: the contract a mixture-of-experts layer meets, and the search for it.

An *experts module* is the module that holds one layer's experts and runs them:

- an int attribute ``num_experts``;
- its own parameters stacked over the experts along dim 0: each of shape
  ``[num_experts, ...]`` (expert ``e``'s weights are ``param[e]``), at least
  one of them a stack of matrices (3-D; a router's ``[num_experts, H]``
  weight alone does not make an experts module);
- ``forward(hidden_states, top_k_index, top_k_weights)``: ``[T, H]`` tokens,
  ``[T, k]`` expert ids and ``[T, k]`` router weights in, ``[T, H]`` out, the
  sum over each token's ``k`` experts of weight times that expert's output.

That is how transformers (5.x) holds every mixture of experts it ships
(``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``,
``DeepseekV3NaiveMoe``...: fused 3-D ``gate_up_proj`` / ``down_proj``) beside a
router (``gate``) whose output the block hands to ``experts``. The router,
and everything else, stays as it is; only the experts module's forward is
replaced (``faccel._loop._strategies._experts._dispatch``). ``prepare(..., experts=[names])``
names the experts modules where the search below finds none (or finds too many).
Pure: reads the model, changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from faccel.errors import PrepareError

__all__ = ["experts_problem", "find_experts"]


def experts_problem(module: nn.Module) -> str:
    """Why ``module`` does not meet the experts contract; empty if it does.

    Example:
        >>> import torch
        >>> class Experts(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.num_experts = 4
        ...         self.w = torch.nn.Parameter(torch.zeros(4, 3, 2))
        >>> experts_problem(Experts()), experts_problem(torch.nn.Linear(2, 2))[:40]
        ('', 'Linear has no int attribute num_experts ')
    """
    kind = type(module).__name__
    count = getattr(module, "num_experts", None)
    if type(count) is not int or count < 1:
        return f"{kind} has no int attribute num_experts (the experts it holds)"
    own = dict(module.named_parameters(recurse=False))
    if not own:
        return f"{kind} holds no parameters of its own (its experts' weights stacked along dim 0)"
    for name, param in own.items():
        if param.dim() < 1 or param.shape[0] != count:
            shape = tuple(param.shape)
            return f"{kind}.{name} has shape {shape}, not stacked over its {count} experts along dim 0"
    if not any(param.dim() >= 3 for param in own.values()):
        return f"{kind} holds no stacked weight matrices ([num_experts, in, out] parameters)"
    inner = [name for name, sub in module.named_modules() if sub is not module and any(sub.parameters(False))]
    if inner:
        return f"{kind} has submodules with parameters ({inner[:3]}), which could not be split by expert"
    return ""


def find_experts(model: nn.Module, names: Sequence[str] | None = None) -> dict[str, nn.Module]:
    """The experts modules of ``model`` by name: those ``names`` gives, else every one meeting the contract.

    Raises:
        PrepareError: A named module is missing or breaks the contract, or (unnamed) none is found.

    Example:
        >>> import torch
        >>> class Experts(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.num_experts = 4
        ...         self.w = torch.nn.Parameter(torch.zeros(4, 3, 2))
        >>> model = torch.nn.ModuleDict({"gate": torch.nn.Linear(2, 4), "experts": Experts()})
        >>> list(find_experts(model))
        ['experts']
    """
    modules = dict(model.named_modules())
    if names is not None:
        found = {}
        for name in names:
            if name not in modules:
                msg = (
                    f"prepare(..., experts=) names {name!r}, which is no submodule of the model; "
                    "names are as in model.named_modules()"
                )
                raise PrepareError(msg)
            problem = experts_problem(modules[name])
            if problem:
                msg = f"prepare(..., experts=) names {name!r}, but {problem}; {_CONTRACT}"
                raise PrepareError(msg)
            found[name] = modules[name]
        return found
    found = {name: module for name, module in modules.items() if not experts_problem(module)}
    if not found:
        msg = (
            f"Layout(expert=...) splits a model's experts, but no submodule of the {type(model).__name__} "
            f"holds experts as faccel can split them: {_CONTRACT}; name yours with "
            "prepare(..., experts=[...])"
        )
        raise PrepareError(msg)
    return found


_CONTRACT = (
    "an experts module has an int num_experts, its own parameters stacked over the experts along dim 0 "
    "(some 3-D), "
    "and forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], as "
    "transformers' MixtralExperts and Qwen2MoeExperts (docs/parallelism.md, 'Mixture of experts')"
)
