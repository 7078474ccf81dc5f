"""The loop-strategy protocol: what the training loop asks of the strategy a run uses.

A strategy (one process, DDP, FSDP2, the DeviceMesh's tensor parallelism and HSDP, DeepSpeed's
ZeRO, pipeline stages) prepares and trains a model its own way. The generic loop (``prepare``,
``backward``, ``forward_backward``, clipping, ``uneven_inputs``, ``unwrap_model``) never asks which
strategy runs; it asks the :class:`LoopStrategy` that ``faccel._loop._strategies`` chose, which
answers:

- **choice**: :meth:`~LoopStrategy.applies` (whether a run's ``DistState`` uses it; the table's
  first match is the run's strategy) and :meth:`~LoopStrategy.holds` (whether a prepared model,
  or the parameters given to clipping, are this strategy's);
- **prepare**: :meth:`~LoopStrategy.check_options` (the options it has no use for, refused by
  name), :attr:`~LoopStrategy.whole_model` (a meta-built model made whole before it is handed
  over), :meth:`~LoopStrategy.prepare` (the whole call; DeepSpeed builds one engine from the model
  and its optimizer), :meth:`~LoopStrategy.prepare_model` (one model: moved and wrapped, or cut
  into stages), :meth:`~LoopStrategy.wrap` and :meth:`~LoopStrategy.shards_first` (what
  ``prepare_model`` does with it), :meth:`~LoopStrategy.replaces_parameters` (whether an
  optimizer prepared before its model must look again at its first step);
- **the step**: :meth:`~LoopStrategy.backward` (the loss's backward, with the micro-step's sync
  boundary), :meth:`~LoopStrategy.forward_backward` (a whole step, where a schedule runs it),
  :meth:`~LoopStrategy.clip_grad_norm` and :meth:`~LoopStrategy.check_clip`;
- **the rest**: :meth:`~LoopStrategy.unwrap` (the layer it added), :meth:`~LoopStrategy.given`
  (the whole model given to ``prepare``, where a rank holds only stages of it),
  :meth:`~LoopStrategy.uneven_problem` (why ``uneven_inputs`` cannot join the model),
  :attr:`~LoopStrategy.config_kinds` (objects that stand for a section of its config, refused
  under any other strategy).

:class:`LoopStrategy` itself answers every question as a plain model does (the floor: nothing
wrapped, torch's own backward and clipping); a strategy subclasses it and overrides what it does
differently. A new strategy is one module of this package and one row of ``LOOP_STRATEGIES`` in
``__init__.py`` (docs/architecture.md, "how to add a strategy").
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from faccel._dist._state import DistState
from faccel._loop._activation_checkpoint import checkpoint_activations
from faccel._loop._materialize import materialize, prepare_meta
from faccel._loop._model import Autocast, is_sharded, peel
from faccel._loop._options import PrepareOptions
from faccel._loop._strategies._experts._dispatch import split_experts
from faccel._marks import WRAPPED_AS
from faccel.errors import PrepareError

__all__ = ["LoopStrategy", "check_fsdp_options", "shards_with_fsdp", "uses_mesh"]

# How ``prepare`` handles one object (loaders, schedulers, tags), for a strategy that prepares the call whole.
PrepareOne = Callable[[Any], Any]


def uses_mesh(dist: DistState) -> bool:
    """Whether ``dist``'s layout needs the DeviceMesh: tensor parallelism, or FSDP2 with replicas (HSDP).

    The layouts every strategy had before layouts existed (DDP over all
    ranks, FSDP2 over all ranks) keep their own path.

    Example:
        >>> import faccel
        >>> layout = faccel.Layout(tensor=4)
        >>> uses_mesh(faccel.DistState.simulated(world_size=4, strategy="fsdp", layout=layout))
        True
    """
    layout = dist.layout
    if layout is None:
        return False
    return layout.tensor > 1 or (dist.strategy == "fsdp" and layout.replicate > 1)


def shards_with_fsdp(dist: DistState) -> bool:
    """Whether ``dist``'s strategy and layout give a model to FSDP2's ``fully_shard`` (on peer processes).

    ``strategy='fsdp'`` does, and so does a layout with tensor parallelism and
    data-parallel ranks (FSDP2 shards over those). In one process nothing is
    sharded, but the FSDP2 options are accepted, so one script runs at any size.

    Example:
        >>> import faccel
        >>> shards_with_fsdp(faccel.DistState(strategy="fsdp")), shards_with_fsdp(faccel.DistState())
        (True, False)
    """
    return dist.strategy == "fsdp" or (uses_mesh(dist) and dist.parallel.data_size > 1)


def check_fsdp_options(dist: DistState, options: PrepareOptions) -> None:
    """Refuse FSDP2's options (``offload``, ``reshard_after_forward=False``) where FSDP2 shards nothing.

    Raises:
        PrepareError: An FSDP2 option under a strategy and layout that do not shard with FSDP2.
    """
    if options.asks_fsdp and not shards_with_fsdp(dist):
        asked = (
            f"offload={options.offload!r}" if options.offload is not None else "reshard_after_forward=False"
        )
        msg = (
            f"prepare got {asked}, an FSDP2 option, but strategy={dist.strategy!r} does not shard "
            "the model with FSDP2; detect(strategy='fsdp') to shard it, or drop the option "
            "(under DeepSpeed, offload is the config's zero_optimization.offload_param and "
            "offload_optimizer)"
        )
        raise PrepareError(msg)


def _check_prepared(dist: DistState, model: nn.Module) -> nn.Module:
    is_ddp = isinstance(model, DistributedDataParallel)
    inner = model.module if is_ddp else model
    dtype = inner.dtype if isinstance(inner, Autocast) else None
    wants_ddp = dist.distributed and not uses_mesh(dist)
    if is_ddp != wants_ddp or dtype != dist.autocast_dtype:
        msg = (
            f"this model was prepared under another DistState (DDP: {is_ddp}, autocast: {dtype}); "
            f"this one wants DDP: {wants_ddp}, autocast: {dist.autocast_dtype}. "
            "Prepare the unwrapped model (faccel.unwrap_model(model)) instead"
        )
        raise PrepareError(msg)
    return model


class LoopStrategy:
    """What the training loop asks of a strategy (see the module's docstring), with the floor's answers.

    The floor's answers are a plain model's: nothing wrapped, torch's backward
    and clipping. A strategy subclasses this and overrides what it does differently.

    Example:
        >>> import torch, faccel
        >>> LoopStrategy().unwrap(torch.nn.Linear(1, 1)) is None
        True
    """

    name = "floor"
    # A meta-built model is made real and whole before the strategy takes it (DeepSpeed's engine).
    whole_model = False
    # Kinds of objects that stand for a section of this strategy's config (refused under the others).
    config_kinds: tuple[type, ...] = ()

    def applies(self, dist: DistState) -> bool:
        """Whether ``dist``'s run uses this strategy (the table's first match is the run's); the floor: no."""
        return False

    def holds(self, model: object, params: Sequence[torch.Tensor] = ()) -> bool:
        """Whether ``model`` (as prepared), or clipped ``params``, are this strategy's (floor: no)."""
        return False

    def check_options(self, dist: DistState, options: PrepareOptions) -> None:
        """Refuse the options this strategy has no use for: FSDP2's where nothing is sharded, DDP's hooks
        where DDP does not wrap."""
        from faccel._loop._strategies._ddp._comm_hooks import check_comm_hook

        check_fsdp_options(dist, options)
        check_comm_hook(dist, options.comm_hook, options.comm_hook_options)

    def prepare(self, dist: DistState, objs: Sequence[Any], prepare_one: PrepareOne) -> tuple[Any, ...]:
        """Every object of one ``prepare`` call, in the order given: modules first, then the rest.

        Preparing a module may replace its parameters, and optimizers in the
        same call must see the replacements.
        """
        ready = {i: prepare_one(obj) for i, obj in enumerate(objs) if isinstance(obj, nn.Module)}
        return tuple(ready[i] if i in ready else prepare_one(obj) for i, obj in enumerate(objs))

    def prepare_model(self, dist: DistState, model: nn.Module, options: PrepareOptions) -> nn.Module:
        """One model made ready: moved to ``dist.device`` (in place) and wrapped by :meth:`wrap`.

        Under FSDP2 ``fully_shard`` changes the module in place (its class and
        its parameters, which become DTensors); that is FSDP2's design.
        """
        if options.activation_checkpointing is not None:
            # Before sharding, on a first prepare: FSDP2's hooks then run around the recomputed forward.
            # On a module prepared before (its wrapper comes back below) it is added where it is missing:
            # an instance forward inside DDP's or FSDP2's hooks works the same either way.
            checkpoint_activations(peel(model), options.activation_checkpointing)
        if isinstance(model, DistributedDataParallel | Autocast):
            return _check_prepared(dist, model)
        # The same module prepared again gets the wrapper it got the first time: a second DDP
        # around it would reduce its gradients twice. (A copy of the module carries the weak
        # reference too, hence the check that the wrapper holds this very module.)
        earlier = model.__dict__.get(WRAPPED_AS)
        wrapper = earlier() if earlier is not None else None
        if wrapper is not None and peel(wrapper) is model:
            return _check_prepared(dist, wrapper)
        if is_sharded(model):  # after the wrapper: tensor parallelism alone may wear an Autocast
            return model
        # A meta-built model is sharded first, then only this rank's part is allocated (_materialize).
        shards_first = self.shards_first(dist)
        meta = prepare_meta(model, dist.device, options.init, shards_first=shards_first)
        if not meta:
            model.to(dist.device)  # in place: the optimizer's parameter references stay valid
        split_experts(dist, model, options)  # expert parallelism: this rank's experts, the dispatch forward
        wrapped = self.wrap(dist, model, options)
        if meta and shards_first:
            materialize(model, dist.device, options.init)
        if wrapped is not model:
            # object.__setattr__: nn.Module's own would register the wrapper as a submodule.
            object.__setattr__(model, WRAPPED_AS, weakref.ref(wrapped))
        return wrapped

    def wrap(self, dist: DistState, model: nn.Module, options: PrepareOptions) -> nn.Module:
        """A model already on its device, wrapped: autocast where ``dist.precision`` asks for it."""
        if dist.autocast_dtype is not None:
            return Autocast(model, device_type=dist.device.type, dtype=dist.autocast_dtype)
        return model

    def shards_first(self, dist: DistState) -> bool:
        """Whether a meta-built model is sharded before it is allocated (this rank's part); the floor: no."""
        return False

    def replaces_parameters(self, dist: DistState) -> bool:
        """Whether wrapping replaces the parameters (an optimizer prepared first looks again); floor: no."""
        return False

    def unwrap(self, model: object) -> nn.Module | None:
        """The module inside the layer this strategy added, or None; the floor adds none."""
        return None

    def backward(self, dist: DistState, loss: torch.Tensor, *, sync: bool, kwargs: dict[str, Any]) -> bool:
        """Run the backward this strategy's way (``sync``: the micro-step's boundary); False: not done,
        ``faccel.backward`` runs torch's."""
        return False

    def forward_backward(
        self,
        dist: DistState,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor],
        args: tuple[Any, ...],
        targets: Any,
        *,
        micro: Any,
        items: int | None,
        scaler: torch.amp.GradScaler | None,
    ) -> torch.Tensor | None:
        """A whole step where the strategy runs it (a schedule); None: ``forward_backward`` runs the
        forward, then ``faccel.backward``."""
        return None

    def check_clip(self, model_or_params: object, params: Sequence[torch.Tensor]) -> None:
        """Refuse clipping where the step does not use the parameters' ``.grad``; the floor: any clip."""

    def clip_grad_norm(
        self,
        dist: DistState,
        params: list[torch.Tensor],
        max_norm: float,
        *,
        norm_type: float,
        error_if_nonfinite: bool,
        foreach: bool | None,
    ) -> torch.Tensor | None:
        """Clip by a norm combined this strategy's way; None: the generic clip (torch's, mesh by mesh)."""
        return None

    def uneven_problem(self, model: object) -> str | None:
        """Why ``uneven_inputs`` cannot join ``model``, or None; only DDP's ``Join`` shadows a finished
        rank's collectives."""
        return (
            f"uneven_inputs needs the DistributedDataParallel model faccel.prepare returned, got a "
            f"{type(model).__name__}; pass the prepared model (FSDP2 models cannot join: keep "
            "even_batches=True with them, which gives every rank the same number of batches)"
        )

    def given(self, model: object) -> nn.Module | None:
        """The whole model given to ``prepare`` where a rank holds only stages of it; else None."""
        return None
