"""Activation checkpointing: the submodules a selector matches recompute their activations in the backward.

``prepare(..., activation_checkpointing=Block)`` takes a module class, a tuple
of classes, or a predicate ``fn(module) -> bool``. Each matched submodule
(the outermost ones: a match inside a match is already recomputed) keeps its
class, its parameters and its place in the tree, so ``state_dict`` keys,
``named_parameters`` names, checkpoints and ``save_model`` are unchanged. It
gets one instance attribute, ``forward``, that runs its class's ``forward``
through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
preserve_rng_state=True)``: the forward saves only its inputs, and the
backward runs it again, with the same random numbers (dropout masks), so the
gradients are bitwise those of the run without it. It is applied before any
wrapping, so FSDP2's hooks (``fully_shard`` of a matched block) run around
it, and DDP, tensor parallelism and ``torch.compile`` see an ordinary module.
The attribute is listed with faccel's other marks in ``faccel._marks``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, no_type_check

from torch import nn
from torch.utils.checkpoint import checkpoint

from faccel.errors import ArgumentValueError, PrepareError

__all__ = [
    "check_selector",
    "checkpoint_activations",
    "is_checkpointed",
    "matches_problem",
    "selector_problem",
]

Selector = type | tuple[type, ...] | Callable[[nn.Module], bool]


# no_type_check: the test suite's typeguard hook would add checks inside every forward, which
# torch.compile cannot trace (a graph break in the middle of the user's model).
@no_type_check
def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The class's forward (FSDP2's subclass inherits the user's), bound to this module.
    forward = type(self).forward.__get__(self, type(self))
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module``'s forward is faccel's checkpointed one.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> _ = checkpoint_activations(net, torch.nn.Linear)
        >>> is_checkpointed(net[0]), is_checkpointed(net)
        (True, False)
    """
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) is _checkpointed_forward


def selector_problem(selector: object) -> str:
    """What is wrong with ``selector`` as an ``activation_checkpointing`` value; empty when nothing.

    Example:
        >>> import torch
        >>> selector_problem(torch.nn.Linear), selector_problem((torch.nn.Linear, torch.nn.ReLU))
        ('', '')
        >>> selector_problem("Block")[:58]
        'activation_checkpointing must be a module class, a tuple o'
    """
    if isinstance(selector, tuple):
        if selector and all(isinstance(kind, type) and issubclass(kind, nn.Module) for kind in selector):
            return ""
    elif isinstance(selector, type):
        if issubclass(selector, nn.Module):
            return ""
    elif callable(selector):
        return ""
    return (
        "activation_checkpointing must be a module class, a tuple of module classes or a predicate "
        f"fn(module) -> bool, got {selector!r}; pass the class of your transformer block "
        "(activation_checkpointing=Block) or a function that picks the submodules to recompute"
    )


def check_selector(selector: object) -> None:
    """Raise :class:`~faccel.errors.ArgumentValueError` when :func:`selector_problem` finds one."""
    problem = selector_problem(selector)
    if problem:
        raise ArgumentValueError(problem)


def _predicate(selector: Selector) -> Callable[[nn.Module], bool]:
    if isinstance(selector, type | tuple):
        kinds = selector
        return lambda module: isinstance(module, kinds)
    return selector


def _selected(model: nn.Module, selector: Selector) -> list[tuple[str, nn.Module]]:
    """The outermost submodules (``model`` included) that ``selector`` matches, in ``named_modules`` order.

    A match inside a module already checkpointed (by an earlier ``prepare``) is left out too: it is
    recomputed with that module.
    """
    wants = _predicate(selector)
    chosen: list[tuple[str, nn.Module]] = []
    covered: list[str] = []
    for name, module in model.named_modules():
        if any(outer == "" or name.startswith(outer + ".") for outer in covered):
            continue
        if wants(module):
            chosen.append((name, module))
            covered.append(name)
        elif is_checkpointed(module):
            covered.append(name)
    return chosen


def matches_problem(model: nn.Module, selector: Selector) -> str:
    """What is wrong with ``selector`` for ``model``; empty when it matches at least one submodule.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> matches_problem(net, torch.nn.Linear)
        ''
        >>> matches_problem(net, torch.nn.Conv1d)[:54]
        'activation_checkpointing=Conv1d matches no submodule o'
    """
    wants = _predicate(selector)
    if any(wants(module) for module in model.modules()):
        return ""
    if isinstance(selector, type):
        what = selector.__name__
    elif isinstance(selector, tuple):
        what = "(" + ", ".join(kind.__name__ for kind in selector) + ")"
    else:
        what = getattr(selector, "__name__", repr(selector))
    kinds = sorted({type(module).__name__ for module in model.modules()})
    known = ", ".join(kinds[:12]) + (" ..." if len(kinds) > 12 else "")
    return (
        f"activation_checkpointing={what} matches no submodule of the {type(model).__name__} "
        f"(its module classes: {known}), so nothing would be recomputed; pass the class of the "
        "blocks to recompute, or a predicate that returns True for them"
    )


def checkpoint_activations(model: nn.Module, selector: Selector) -> list[str]:
    """Give each outermost submodule of ``model`` that ``selector`` matches a checkpointed forward, in place.

    Returns the matched names (``''`` for ``model`` itself). A module already
    checkpointed (prepared before) is left as it is.

    Raises:
        ArgumentValueError: ``selector`` is not a class, a tuple of classes or a callable.
        PrepareError: It matches no submodule, or a matched submodule already has a
            ``forward`` of its own instance (a hook library's), which faccel would replace.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
        >>> checkpoint_activations(net, torch.nn.Linear)
        ['0', '2']
        >>> list(net.state_dict()) == ['0.weight', '0.bias', '2.weight', '2.bias']
        True
    """
    check_selector(selector)
    problem = matches_problem(model, selector)
    if problem:
        raise PrepareError(problem)
    chosen = _selected(model, selector)
    for name, module in chosen:
        if "forward" in module.__dict__ and not is_checkpointed(module):
            msg = (
                f"activation_checkpointing matched {name or 'the model'} ({type(module).__name__}), "
                "whose forward was replaced on the instance (by a hook library, or by hand); faccel "
                "would replace it again. Restore the class's forward (del module.forward) or select "
                "other submodules"
            )
            raise PrepareError(msg)
    for _, module in chosen:
        if not is_checkpointed(module):
            # object.__setattr__: an instance attribute, outside nn.Module's registries (no state_dict key).
            object.__setattr__(module, "forward", types.MethodType(_checkpointed_forward, module))
    return [name for name, _ in chosen]
