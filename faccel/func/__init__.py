"""faccel.func: functional training, as ``torch.func`` and optax write it.

Parameters as a pytree (:func:`model_params`), a pure loss-and-gradient
(:func:`loss_and_grad`), gradients averaged across processes
(:func:`sync_grads`, :func:`grad_buckets`), pure optimizers (:func:`sgd`,
:func:`adamw`, :func:`param_groups`, or your own: anything that follows the
:class:`Optimizer` protocol), and the frozen :class:`FunctionalState` that
holds it all, a pytree (:func:`register_pytree`, :func:`static_field`,
:func:`tree_map`).

Like ``faccel``, every name is imported on first use; ``__all__`` comes from
the public table in ``faccel/_public.py``.

Example:
    >>> import torch, faccel
    >>> opt = faccel.func.sgd(0.5)
    >>> state = faccel.func.FunctionalState.create(params={"w": torch.ones(2)}, optimizer=opt)
    >>> state.apply_gradients({"w": torch.ones(2)}).params["w"].tolist()
    [0.5, 0.5]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from faccel._public import namespace as _namespace

# PUBLIC["faccel.func"] of faccel/_public.py again, for type checkers and IDEs (tests/test_api.py compares)
if TYPE_CHECKING:
    from faccel._func._functional import FunctionalState as FunctionalState
    from faccel._func._functional import loss_and_grad as loss_and_grad
    from faccel._func._functional import model_params as model_params
    from faccel._func._grad_sync import GradBuckets as GradBuckets
    from faccel._func._grad_sync import grad_buckets as grad_buckets
    from faccel._func._grad_sync import sync_grads as sync_grads
    from faccel._func._optim._adamw import AdamWState as AdamWState
    from faccel._func._optim._adamw import adamw as adamw
    from faccel._func._optim._base import Optimizer as Optimizer
    from faccel._func._optim._groups import ParamGroupsState as ParamGroupsState
    from faccel._func._optim._groups import param_groups as param_groups
    from faccel._func._optim._sgd import SGDState as SGDState
    from faccel._func._optim._sgd import sgd as sgd
    from faccel._tree import register_pytree as register_pytree
    from faccel._tree import static_field as static_field
    from faccel._tree import tree_map as tree_map

__all__, __getattr__, __dir__ = _namespace(__name__, globals())
