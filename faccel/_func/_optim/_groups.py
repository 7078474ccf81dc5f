"""Parameter groups: each parameter updated by the optimizer of its group, as torch.optim's param groups.

An optimizer made of optimizers (optax's ``multi_transform``): a function
names each parameter's group, and each group has its own pure optimizer, so
any hyperparameter (weight decay, learning rate, betas) can differ between
groups. The classic use is weight decay on matrices but not on biases and
norm weights (nanoGPT's ``configure_optimizers``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from faccel._func._optim._base import Optimizer, check, leaves_like
from faccel._tree import flatten, keystr, register_pytree, tree_flatten_with_path, unflatten
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentError, FunctionalError

__all__ = ["ParamGroups", "ParamGroupsState", "param_groups"]


@register_pytree
@attrs.frozen(kw_only=True)
class ParamGroupsState:
    """State of :func:`faccel.func.param_groups`: each group's optimizer state, by group name.

    Each group's state covers that group's parameters only, as a dict keyed
    by the parameters' names (a flat dict's keys; for other trees, the leaves'
    paths as ``torch.utils._pytree.keystr`` writes them).

    Attributes:
        groups: Group name to the state of that group's optimizer.

    Example:
        >>> import torch, faccel
        >>> opt = faccel.func.param_groups(
        ...     lambda params: {name: "all" for name in params}, {"all": faccel.func.sgd(0.1, momentum=0.9)})
        >>> state = opt.init({"w": torch.ones(2)})
        >>> sorted(state.groups), state.groups["all"].momentum_buffer["w"].tolist()
        (['all'], [0.0, 0.0])
    """

    groups: dict[str, Any]


@attrs.frozen(kw_only=True)
class ParamGroups:
    """Parameters in named groups, one pure optimizer each; made by :func:`faccel.func.param_groups`."""

    labels: Callable[[Any], Any]
    optimizers: tuple[tuple[str, Optimizer], ...]

    def _split(self, params: Any) -> tuple[list[Any], Any, list[Any], dict[str, list[int]]]:
        """Params' leaves, structure, leaf names, and the leaf indices of each group."""
        leaves, spec = flatten(params)
        if type(spec) is tuple:  # a flat dict: its keys
            names: list[Any] = list(spec)
        else:
            names = [keystr(path) for path, _ in tree_flatten_with_path(params)[0]]
        labels = leaves_like(self.labels(params), params, spec, "labels(params)")
        members: dict[str, list[int]] = {name: [] for name, _ in self.optimizers}
        for i, label in enumerate(labels):
            if label not in members:
                msg = (
                    f"labels(params) put parameter {names[i]!r} in group {label!r}, which is not one of "
                    f"the groups {sorted(members)}"
                )
                raise FunctionalError(msg)
            members[label].append(i)
        return leaves, spec, names, members

    def init(self, params: Any) -> ParamGroupsState:
        """Each group's optimizer's ``init`` over that group's parameters.

        Example:
            >>> import torch, faccel
            >>> opt = faccel.func.param_groups(
            ...     lambda params: {n: "decay" if p.dim() >= 2 else "none" for n, p in params.items()},
            ...     {"decay": faccel.func.adamw(weight_decay=0.1), "none": faccel.func.adamw(weight_decay=0)})
            >>> state = opt.init({"w": torch.ones(2, 2), "b": torch.ones(2)})
            >>> sorted(state.groups["decay"].exp_avg), sorted(state.groups["none"].exp_avg)
            (['w'], ['b'])
        """
        leaves, _, names, members = self._split(params)
        return ParamGroupsState(
            groups={
                label: optimizer.init({names[i]: leaves[i] for i in members[label]})
                for label, optimizer in self.optimizers
            }
        )

    def update(
        self, grads: Any, state: ParamGroupsState, params: Any, *, lr: float | None = None
    ) -> tuple[Any, ParamGroupsState]:
        """Each group's update over its parameters, as :meth:`faccel.func.Optimizer.update`.

        ``lr``, when given, is every group's learning rate for this update (as
        setting ``group["lr"]`` on every group of a ``torch.optim`` optimizer).

        Raises:
            FunctionalError: The trees' structures differ, ``labels`` names a
                group that does not exist, or ``state`` is not a
                :class:`ParamGroupsState` of these groups.

        Example:
            >>> import torch, faccel
            >>> groups = {"fast": faccel.func.sgd(1.0), "slow": faccel.func.sgd(0.1)}
            >>> opt = faccel.func.param_groups(lambda _: {"w": "fast", "b": "slow"}, groups)
            >>> params = {"w": torch.ones(1), "b": torch.ones(1)}
            >>> params, state = opt.update({"w": torch.ones(1), "b": torch.ones(1)}, opt.init(params), params)
            >>> params["w"].item(), round(params["b"].item(), 4)
            (0.0, 0.9)
        """
        groups = [label for label, _ in self.optimizers]
        if not isinstance(state, ParamGroupsState) or list(state.groups) != groups:
            msg = (
                f"update() needs the ParamGroupsState made by init() of this optimizer (groups "
                f"{groups}), got {type(state).__name__}; call opt.init(params) first"
            )
            raise FunctionalError(msg)
        leaves, spec, names, members = self._split(params)
        grad_leaves = leaves_like(grads, params, spec, "grads")
        new_leaves = list(leaves)
        new_states: dict[str, Any] = {}
        for label, optimizer in self.optimizers:
            indices = members[label]
            sub_params = {names[i]: leaves[i] for i in indices}
            sub_grads = {names[i]: grad_leaves[i] for i in indices}
            new_sub, new_states[label] = optimizer.update(sub_grads, state.groups[label], sub_params, lr=lr)
            for i in indices:
                new_leaves[i] = new_sub[names[i]]
        return unflatten(new_leaves, spec), ParamGroupsState(groups=new_states)


@setup_checked
def param_groups(labels: Callable[[Any], Any], optimizers: Mapping[str, Optimizer]) -> ParamGroups:
    """Parameter groups over pytrees: each parameter updated by its group's optimizer.

    The functional form of ``torch.optim``'s param groups (and of optax's
    ``multi_transform``). ``labels(params)`` returns a tree like ``params``
    holding each parameter's group name; ``optimizers`` maps every group name
    to a pure optimizer (:func:`faccel.func.sgd`, :func:`faccel.func.adamw`,
    or your own), whose hyperparameters are that group's. A group may be
    empty. The result is itself an optimizer: ``init(params)`` gives a
    :class:`ParamGroupsState`, ``update(grads, state, params, *, lr=None)``
    gives ``(new_params, new_state)``.

    ``labels`` is called with the parameters on every ``init`` and
    ``update`` (and with ``meta``-device copies when a checkpoint is
    restored), so decide from names and shapes, not values. Use a function
    defined once (not a new lambda per call) if two optimizers built
    separately should compare equal.

    Args:
        labels: ``params -> tree of group names`` (a dict of names for a dict of parameters).
        optimizers: Group name to that group's optimizer, in the order the groups are updated.

    Returns:
        The optimizer (a frozen, hashable record).

    Raises:
        ArgumentValueError: No groups.
        ArgumentError: An optimizer that does not have ``init`` and ``update``.

    Example:
        >>> import torch, faccel
        >>> def decay_matrices(params):   # nanoGPT's split: decay 2-D weights, not biases and norms
        ...     return {name: "decay" if p.dim() >= 2 else "no_decay" for name, p in params.items()}
        >>> opt = faccel.func.param_groups(decay_matrices, {
        ...     "decay": faccel.func.adamw(lr=0.1, weight_decay=0.5),
        ...     "no_decay": faccel.func.adamw(lr=0.1, weight_decay=0.0)})
        >>> params = {"w": torch.ones(1, 1), "b": torch.ones(1)}
        >>> zero = {"w": torch.zeros(1, 1), "b": torch.zeros(1)}
        >>> params, state = opt.update(zero, opt.init(params), params)
        >>> params["w"].item(), params["b"].item()   # only the matrix decayed: 1 * (1 - 0.1 * 0.5)
        (0.949999988079071, 1.0)
    """
    check(len(optimizers) > 0, "param_groups() needs at least one group")
    for label, optimizer in optimizers.items():
        if not isinstance(optimizer, Optimizer):
            msg = f"group {label!r}: {type(optimizer).__name__} is not a pure optimizer (init and update)"
            raise ArgumentError(msg)
    return ParamGroups(labels=labels, optimizers=tuple(optimizers.items()))
