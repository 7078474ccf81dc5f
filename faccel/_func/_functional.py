"""Functional training: parameters as a pytree, a pure loss-and-grad, a state record.

Warning, the one that matters: ``torch.func`` transforms and
``torch.func.functional_call`` bypass DistributedDataParallel's gradient
hooks. Gradients computed that way are each rank's own, silently, and the
ranks drift apart. faccel refuses the cases it can see (:func:`model_params`
under a process group unless told ``will_sync_grads=True``;
:func:`loss_and_grad` given a DDP module); for anything else, average every
gradient with :func:`faccel.func.sync_grads` before using it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, get_args

import attrs
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from faccel._choices import Engine
from faccel._dist._state import DistState
from faccel._func._module_call import ModuleCaller
from faccel._func._optim._base import Optimizer, state_from_dict, state_to_dict
from faccel._loop._model import Autocast, float32_outputs, unwrap_model
from faccel._torch_compat import compiled_original
from faccel._tree import register_pytree, static_field
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentValueError, DistributedError, FunctionalError

__all__ = ["FunctionalState", "loss_and_grad", "model_params"]

_ENGINES = get_args(Engine)


def _has_ddp(model: nn.Module) -> bool:
    while True:
        if isinstance(model, DistributedDataParallel):
            return True
        if isinstance(model, Autocast):
            model = model.module
            continue
        inner = compiled_original(model)  # torch.compile's OptimizedModule
        if inner is None:
            return False
        model = inner


@setup_checked
def model_params(
    dist: DistState, model: nn.Module, *, will_sync_grads: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The parameters and buffers of ``model`` as two dicts of tensors, for functional code.

    The model is unwrapped first (:func:`faccel.unwrap_model`: DDP, autocast,
    ``torch.compile``), so names are your module's own (``"0.weight"``) and
    work with ``torch.func.functional_call(unwrap_model(model), (params,
    buffers), inputs)`` and ``model.load_state_dict``. Call it after
    :func:`faccel.prepare`: DDP has then copied rank 0's weights to every rank.
    The tensors are detached copies: the state you train owns them, and
    nothing you do to them touches the module.

    Under a process group, functional gradients are **not** averaged by DDP
    (``functional_call`` and ``torch.func`` bypass its hooks): each rank would
    silently train on its own gradients. So this refuses unless you pass
    ``will_sync_grads=True``, promising to average every gradient with
    :func:`faccel.func.sync_grads` before the update.

    Args:
        dist: The run's :class:`DistState`.
        model: A module, prepared or not.
        will_sync_grads: You will call ``sync_grads`` on every gradient
            (needed when ``dist.distributed``; ignored otherwise).

    Returns:
        ``(params, buffers)``: names to detached copies.

    Raises:
        DistributedError: There are peer processes and ``will_sync_grads`` is False.

    Example:
        >>> import torch, faccel
        >>> model = faccel.prepare(faccel.detect({}), torch.nn.BatchNorm1d(2))
        >>> params, buffers = faccel.func.model_params(faccel.detect({}), model)
        >>> sorted(params), sorted(buffers)
        (['bias', 'weight'], ['num_batches_tracked', 'running_mean', 'running_var'])
    """
    if dist.distributed and not will_sync_grads:
        msg = (
            f"model_params() on rank {dist.rank} of {dist.world_size}: functional code "
            "(torch.func, functional_call) bypasses DDP's gradient hooks, so each rank would "
            "silently train on its own gradients. Average every gradient with "
            "faccel.func.sync_grads(dist, grads) and pass will_sync_grads=True to say you do"
        )
        raise DistributedError(msg)
    module = unwrap_model(model)
    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    return params, buffers


@setup_checked
def loss_and_grad(
    dist: DistState,
    model: nn.Module,
    loss_fn: Callable[..., Any],
    *,
    engine: Engine = "autograd",
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """A pure function ``(params, buffers, inputs, *loss_args) -> (loss, grads)``.

    It computes ``outputs = functional_call(model, (params, buffers),
    inputs)`` (``inputs``: one argument, or a tuple of positional arguments,
    as ``functional_call`` takes them), ``loss = loss_fn(outputs,
    *loss_args)``, and the gradient of ``loss`` with respect to every tensor in
    ``params`` (zeros for unused ones), as a dict like ``params``. Under a
    ``dist`` with mixed precision the forward runs under autocast and the
    outputs are cast to float32, as for a prepared model. What
    ``functional_call`` works out on every call (tied weights, where each
    name lives) is worked out once here, so a call costs about what
    ``model(inputs)`` costs; like ``functional_call``, it swaps your tensors
    into ``model`` while it runs.

    Engines:

    * ``"autograd"`` (default): ``torch.autograd.grad`` on detached copies of
      the leaves marked ``requires_grad``; the fastest eager path.
    * ``"func"``: ``torch.func.grad_and_value``; composes with
      ``torch.func.vmap`` (ensembles, per-sample gradients) and other transforms.

    The gradients are this process's own: under a process group, average
    them with :func:`faccel.func.sync_grads` before the update.

    Args:
        dist: The run's :class:`DistState` (its precision is applied).
        model: The module to call, not wrapped in DDP (pass
            ``faccel.unwrap_model(model)``); autocast and compile wrappers are peeled.
        loss_fn: ``loss_fn(outputs, *loss_args)`` returning a scalar tensor, or
            ``(loss, aux)`` with ``has_aux``.
        engine: ``"autograd"`` or ``"func"``.
        has_aux: ``loss_fn`` returns ``(loss, aux)``; the function then returns
            ``((loss, aux), grads)``.

    Returns:
        The function ``(params, buffers, inputs, *loss_args) -> (loss, grads)``;
        ``loss`` is detached.

    Raises:
        DistributedError: ``model`` is wrapped in ``DistributedDataParallel``:
            its gradient hooks would not run, so ranks would train apart.
        ArgumentValueError: Unknown ``engine``.
        FunctionalError: When called, the ``"autograd"`` engine inside a
            ``torch.func`` transform.

    Example:
        >>> import torch, faccel
        >>> dist = faccel.detect({})
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> grad_fn = faccel.func.loss_and_grad(dist, model, torch.nn.functional.mse_loss)
        >>> params = {"weight": torch.ones(1, 2)}
        >>> loss, grads = grad_fn(params, {}, torch.ones(1, 2), torch.zeros(1, 1))
        >>> loss.item(), grads["weight"].tolist()
        (4.0, [[4.0, 4.0]])
    """
    if engine not in _ENGINES:
        msg = f"engine must be one of {_ENGINES}, got {engine!r}"
        raise ArgumentValueError(msg)
    if _has_ddp(model):
        msg = (
            "loss_and_grad() got a DistributedDataParallel module: functional_call and torch.func "
            "bypass DDP's gradient hooks, so each rank would silently train on its own gradients. "
            "Pass faccel.unwrap_model(model) and average the gradients with "
            "faccel.func.sync_grads(dist, grads)"
        )
        raise DistributedError(msg)
    module = unwrap_model(model)
    dtype = dist.autocast_dtype
    device_type = dist.device.type
    # functional_call's per-call bookkeeping, done once (see _module_call).
    call = ModuleCaller(module)

    def forward_loss(params: Any, buffers: Any, inputs: Any, *loss_args: Any) -> Any:
        if dtype is None:
            outputs = call(params, buffers, inputs)
        else:
            with torch.autocast(device_type, dtype=dtype):
                outputs = call(params, buffers, inputs)
            outputs = float32_outputs(outputs)
        return loss_fn(outputs, *loss_args)

    if engine == "func":
        grad_and_value = torch.func.grad_and_value(forward_loss, has_aux=has_aux)

        def func_step(params: Any, buffers: Any, inputs: Any, *loss_args: Any) -> tuple[Any, Any]:
            grads, value = grad_and_value(params, buffers, inputs, *loss_args)
            return value, grads

        return func_step

    def autograd_step(params: Any, buffers: Any, inputs: Any, *loss_args: Any) -> tuple[Any, Any]:
        try:
            live = {name: p.detach().requires_grad_() for name, p in params.items()}
        except RuntimeError as error:  # torch refuses requires_grad_ inside vmap/grad
            msg = (
                f"loss_and_grad(engine='autograd') cannot run inside a torch.func transform ({error}); "
                "build it with engine='func' to use it under vmap or grad"
            )
            raise FunctionalError(msg) from error
        with torch.enable_grad():
            result = forward_loss(live, buffers, inputs, *loss_args)
        loss = result[0] if has_aux else result
        grads = torch.autograd.grad(loss, tuple(live.values()), materialize_grads=True)
        grads_tree = dict(zip(live, grads, strict=True))
        if has_aux:
            return (loss.detach(), result[1]), grads_tree
        return loss.detach(), grads_tree

    return autograd_step


@register_pytree
@attrs.frozen(kw_only=True)
class FunctionalState:
    """What functional training changes: parameters, buffers and optimizer state, as a pytree.

    Its leaves are the tensors of ``params``, ``buffers`` and ``opt_state``;
    ``optimizer`` (hyperparameters) and ``step`` are static (in the tree's
    structure, as flax's ``pytree_node=False``), so ``tree_map`` and
    ``torch.func`` transforms see tensors only. Frozen: :meth:`apply_gradients`
    returns a new state.

    Attributes:
        params: Parameter names to tensors (see :func:`model_params`).
        buffers: Buffer names to tensors.
        opt_state: The optimizer's state (:class:`faccel.func.SGDState`, :class:`faccel.func.AdamWState`...).
        optimizer: The pure optimizer (:func:`faccel.func.sgd`, :func:`faccel.func.adamw`, any
            :class:`faccel.func.Optimizer`).
        step: Gradient updates applied so far.

    Example:
        >>> import torch, faccel
        >>> state = faccel.func.FunctionalState.create(
        ...     params={"w": torch.ones(2)}, optimizer=faccel.func.sgd(0.5, momentum=0.9))
        >>> state = state.apply_gradients({"w": torch.ones(2)})
        >>> state.step, state.params["w"].tolist()
        (1, [0.5, 0.5])
        >>> len(faccel.func.tree_map(lambda t: t, state).params)   # step and optimizer ride along
        1
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor] = attrs.field(factory=dict)
    opt_state: Any
    # static_field is a field specifier (it returns attrs.field), not a shared default.
    optimizer: Optimizer = static_field()  # noqa: RUF009
    step: int = static_field(default=0)

    @classmethod
    def create(
        cls,
        *,
        params: dict[str, torch.Tensor],
        optimizer: Optimizer,
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> FunctionalState:
        """The state at step 0, with ``optimizer.init(params)`` as its optimizer state.

        Example:
            >>> import torch, faccel
            >>> opt = faccel.func.sgd(0.1)
            >>> faccel.func.FunctionalState.create(params={"w": torch.ones(1)}, optimizer=opt).step
            0
        """
        return cls(
            params=params,
            buffers={} if buffers is None else buffers,
            opt_state=optimizer.init(params),
            optimizer=optimizer,
        )

    def state_dict(self) -> dict[str, Any]:
        """The state as nested dicts of tensors and ints, for ``TrainState.extras`` and checkpoints.

        Pure: nothing is copied or changed. ``optimizer`` (hyperparameters) is
        left out: it is code, rebuilt by :meth:`from_state_dict`.

        Example:
            >>> import torch, faccel
            >>> opt = faccel.func.adamw()
            >>> state = faccel.func.FunctionalState.create(params={"w": torch.ones(1)}, optimizer=opt)
            >>> saved = state.state_dict()
            >>> sorted(saved), sorted(saved["opt_state"])
            (['buffers', 'opt_state', 'params', 'step'], ['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step'])
        """
        return {
            "params": dict(self.params),
            "buffers": dict(self.buffers),
            "opt_state": state_to_dict(self.opt_state),
            "step": self.step,
        }

    @classmethod
    def from_state_dict(cls, saved: Mapping[str, Any], *, optimizer: Optimizer) -> FunctionalState:
        """The state that :meth:`state_dict` described, with ``optimizer``'s hyperparameters.

        Args:
            saved: What :meth:`state_dict` returned (or a checkpoint restored it to).
            optimizer: The pure optimizer to continue with.

        Returns:
            A new state holding ``saved``'s tensors (not copied).

        Raises:
            FunctionalError: ``saved`` is not such a dict, or its optimizer state
                does not fit ``optimizer`` and the parameters.

        Example:
            >>> import torch, faccel
            >>> opt = faccel.func.sgd(0.1, momentum=0.9)
            >>> state = faccel.func.FunctionalState.create(params={"w": torch.ones(2)}, optimizer=opt)
            >>> state = state.apply_gradients({"w": torch.ones(2)})
            >>> again = faccel.func.FunctionalState.from_state_dict(state.state_dict(), optimizer=opt)
            >>> again.step, again.opt_state.step, torch.equal(again.params["w"], state.params["w"])
            (1, 1, True)
        """
        opt_state = saved.get("opt_state") if isinstance(saved, Mapping) else None
        if (
            not isinstance(saved, Mapping)
            or set(saved) != {"params", "buffers", "opt_state", "step"}
            or not isinstance(opt_state, Mapping)
            or type(saved["step"]) is not int
        ):
            keys = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
            msg = (
                f"from_state_dict() needs what FunctionalState.state_dict() returns "
                f"({{params, buffers, opt_state, step}}) for {optimizer!r}, got {keys}; "
                "pass the optimizer the state was trained with"
            )
            raise FunctionalError(msg)
        params = dict(saved["params"])
        restored = state_from_dict(optimizer, opt_state, params)
        return cls(
            params=params,
            buffers=dict(saved["buffers"]),
            opt_state=restored,
            optimizer=optimizer,
            step=saved["step"],
        )

    def apply_gradients(self, grads: dict[str, torch.Tensor], *, lr: float | None = None) -> FunctionalState:
        """The state after one optimizer update with ``grads`` (already synced across ranks).

        Args:
            grads: Gradients, a dict like ``params``.
            lr: This step's learning rate (a schedule's value); default the optimizer's.

        Returns:
            A new state, ``step`` one higher.

        Example:
            >>> import torch, faccel
            >>> opt = faccel.func.sgd(1.0)
            >>> state = faccel.func.FunctionalState.create(params={"w": torch.ones(1)}, optimizer=opt)
            >>> state.apply_gradients({"w": torch.ones(1)}, lr=0.25).params["w"].tolist()
            [0.75]
        """
        params, opt_state = self.optimizer.update(grads, self.opt_state, self.params, lr=lr)
        return attrs.evolve(self, params=params, opt_state=opt_state, step=self.step + 1)
