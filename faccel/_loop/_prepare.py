"""``prepare``: each object made ready for the DistState, returned in the order given."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from faccel._choices import CommHookName, Init, Offload, WorkerSeeds
from faccel._data._loader import PreparedLoader, prepare_loader
from faccel._dist._process_group import breadcrumb
from faccel._dist._state import DistState
from faccel._loop._consistency import check_setup
from faccel._loop._context import check_context
from faccel._loop._materialize import prepare_meta
from faccel._loop._options import PrepareOptions
from faccel._loop._strategies import CONFIG_KINDS, Schedule, loop_strategy
from faccel._marks import OTHER_STAGE, REPLACED_BY, WHOLE_GROUPS
from faccel._typecheck import setup_checked
from faccel.errors import PrepareError

__all__ = ["prepare"]

_Options = PrepareOptions


# Set on a Parameter that preparing its module replaced by another object (FSDP2's
# DTensor parameters; Module.to() for some devices): the one the optimizer must step.
# Listed, with the other marks, in faccel._marks.
_REPLACED_BY = REPLACED_BY
_OTHER_STAGE = OTHER_STAGE


def _module(dist: DistState, obj: Any, options: _Options) -> Any:
    before = list(obj.parameters())
    prepared = loop_strategy(dist).prepare_model(dist, obj, options)
    # Module.to() swaps tensor data in place for CPU <-> CUDA, but makes new Parameter
    # objects for some devices (meta, XLA), as fully_shard does (DTensors). The old
    # object is left behind, untrained; it says what replaced it, so an optimizer that
    # holds it is pointed at the new one whenever (and in whatever call) it is prepared.
    for old, new in zip(before, obj.parameters(), strict=True):
        if old is not new:
            setattr(old, _REPLACED_BY, new)
    return prepared


def _materialize_whole(dist: DistState, objs: tuple[Any, ...], options: _Options) -> None:
    """A meta-built model made real and whole (as under DDP), the optimizers pointed at its parameters.

    DeepSpeed's engine takes a real model (it partitions it itself under ZeRO-3).
    """
    materialized = False
    for obj in objs:
        if isinstance(obj, nn.Module):
            before = list(obj.parameters())
            if prepare_meta(obj, dist.device, options.init, shards_first=False):
                materialized = True
                for old, new in zip(before, obj.parameters(), strict=True):
                    if old is not new:
                        setattr(old, _REPLACED_BY, new)
    for obj in objs:
        if materialized and isinstance(obj, torch.optim.Optimizer):
            _rebind(obj)


def _rebind(optimizer: torch.optim.Optimizer) -> bool:
    """Point ``optimizer`` at the parameters that replaced its own; whether all were final."""
    settled = True
    groups = [list(group["params"]) for group in optimizer.param_groups]
    if not hasattr(optimizer, WHOLE_GROUPS) and any(
        getattr(p, _OTHER_STAGE, False) for g in groups for p in g
    ):
        setattr(
            optimizer, WHOLE_GROUPS, groups
        )  # every stage's parameters, as given: checkpoints number them
    for group in optimizer.param_groups:
        params = group["params"]
        # Parameters another pipeline stage holds: never stepped here (faccel._loop._strategies._pipeline).
        params[:] = [p for p in params if not getattr(p, _OTHER_STAGE, False)]
        for index, param in enumerate(params):
            new = getattr(param, _REPLACED_BY, None)
            if new is not None:
                params[index] = new
                if param in optimizer.state:
                    optimizer.state[new] = optimizer.state.pop(param)
            settled = settled and not _replaceable(new if new is not None else param)
    return settled


def _replaceable(param: torch.Tensor) -> bool:
    # A DTensor parameter is what FSDP2 made: nothing replaces it again. (Looked up, not
    # imported: importing torch.distributed.tensor costs seconds, and without it no
    # DTensor exists.)
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is None or not isinstance(param, dtensor.DTensor)


def _optimizer(dist: DistState, optimizer: Any, options: _Options) -> Any:
    # The optimizer holds the same Parameter objects the model moved, so it needs no
    # wrapper; state loaded earlier (on another device) follows its parameter.
    if not _rebind(optimizer) and loop_strategy(dist).replaces_parameters(dist):
        # Prepared before its model (an earlier prepare call): the model's sharding (or plan) will
        # replace these parameters, so look again just before the first step.
        # The hook is held by dist.runtime (shutdown removes it) and listed in faccel._marks.
        def first_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            _rebind(opt)
            dist.runtime.release(handle)

        handle = dist.runtime.hold(optimizer.register_step_pre_hook(first_step))
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step" and value.device != param.device:
                state[key] = value.to(param.device)
    return optimizer


def _loader(dist: DistState, loader: Any, options: _Options) -> Any:
    return prepare_loader(
        dist,
        loader,
        even_batches=options.even_batches,
        split_batches=options.split_batches,
        worker_seeds=options.worker_seeds,
    )


def _prepared_loader(dist: DistState, loader: Any, options: _Options) -> Any:
    s = loader.sharding
    if (s.rank, s.world_size, s.seed, loader.device) != (
        dist.data_rank,
        dist.data_world_size,
        dist.seed,
        dist.device,
    ):
        msg = (
            f"this loader was prepared for rank {s.rank} of {s.world_size} (seed {s.seed}, "
            f"{loader.device}), not for rank {dist.data_rank} of {dist.data_world_size} (seed {dist.seed}, "
            f"{dist.device}); prepare the original DataLoader (loader.dataloader is the rebuilt one)"
        )
        raise PrepareError(msg)
    return loader


def _unchanged(dist: DistState, obj: Any, options: _Options) -> Any:
    return obj


def _dataset(dist: DistState, obj: Any, options: _Options) -> Any:
    msg = (
        f"prepare() got a {type(obj).__name__} (a Dataset), which it cannot shard or batch; "
        "wrap it in a torch.utils.data.DataLoader(dataset, batch_size=...) and prepare that"
    )
    raise PrepareError(msg)


def _iterator(dist: DistState, obj: Any, options: _Options) -> Any:
    msg = (
        f"prepare() got a {type(obj).__name__}, an iterator it could only pass on half-consumed "
        "(model.parameters() is one); build the optimizer from model.parameters() and prepare "
        "the model and the optimizer"
    )
    raise PrepareError(msg)


def _collection(dist: DistState, obj: Any, options: _Options) -> Any:
    values = obj.values() if isinstance(obj, Mapping) else obj
    if any(isinstance(v, _PREPARABLE) for v in values):
        msg = (
            f"prepare() got a {type(obj).__name__} holding models, optimizers or loaders, which it "
            "would pass back unprepared; pass them one by one: faccel.prepare(dist, *objects)"
        )
        raise PrepareError(msg)
    return obj


def _config_only(dist: DistState, obj: Any, options: _Options) -> Any:
    msg = (
        f"faccel.{type(obj).__name__} stands for what a DeepSpeed config's section builds, and this run's "
        f"strategy is {dist.strategy!r}; use strategy='deepspeed' with a config that has the section "
        "(docs/deepspeed.md), or pass a torch optimizer and scheduler"
    )
    raise PrepareError(msg)


# What prepare does with each kind of object: the first matching row wins.
# LR schedulers pass through unchanged: each scheduler.step() call advances them once,
# so they advance once per optimizer step whatever the world size.
_HANDLERS: tuple[tuple[type | tuple[type, ...], Callable[[DistState, Any, _Options], Any]], ...] = (
    (nn.Module, _module),
    (torch.optim.Optimizer, _optimizer),
    (torch.optim.lr_scheduler.LRScheduler, _unchanged),
    (CONFIG_KINDS, _config_only),
    (DataLoader, _loader),
    (PreparedLoader, _prepared_loader),
    (Dataset, _dataset),
    (Iterator, _iterator),
    (list, _collection),
    (tuple, _collection),
    (Mapping, _collection),
)
_PREPARABLE = (nn.Module, torch.optim.Optimizer, DataLoader, Dataset)


def _prepare_one(dist: DistState, obj: Any, options: _Options) -> Any:
    for kind, handler in _HANDLERS:
        if isinstance(obj, kind):
            return handler(dist, obj, options)
    return obj


@setup_checked
def prepare(
    dist: DistState,
    *objs: Any,
    even_batches: bool = True,
    ddp_kwargs: Mapping[str, Any] | None = None,
    shard_policy: Callable[[nn.Module], bool] | None = None,
    split_batches: bool = False,
    worker_seeds: WorkerSeeds = "rank",
    tp_plan: Mapping[str, Any] | None = None,
    init: Init | Callable[[nn.Module], None] = "reset",
    activation_checkpointing: type | tuple[type, ...] | Callable[[nn.Module], bool] | None = None,
    offload: Offload | None = None,
    reshard_after_forward: bool = True,
    split: Sequence[str] | Callable[[int, int], nn.Module] | None = None,
    schedule: Schedule | None = None,
    example: Any = None,
    comm_hook: CommHookName | None = None,
    comm_hook_options: Mapping[str, Any] | None = None,
    experts: Sequence[str] | None = None,
    expert_capacity: float | None = None,
) -> Any:
    """Make models, optimizers, schedulers and loaders ready for ``dist``.

    Returns the objects in the order given: a tuple, or the object itself when
    given one. Other values (a tag, a config) are returned unchanged, so
    ``prepare`` can take the whole list at once; what looks like a mistake is
    refused: a ``Dataset`` (prepare its ``DataLoader``), an iterator such as
    ``model.parameters()``, or a list, tuple or dict holding models,
    optimizers or loaders (pass them one by one).

    * ``nn.Module``: moved to ``dist.device`` *in place*; wrapped so its forward
      runs under autocast when ``dist.precision`` is not ``'no'``; wrapped in
      ``DistributedDataParallel`` when there are peer processes (or sharded
      with FSDP2 under ``strategy='fsdp'``, which changes the module in
      place). Under DDP your module object is not modified otherwise;
      :func:`unwrap_model` gives it back.
    * Optimizer: returned as is (it already holds the moved parameters; where
      preparing a model makes new Parameter objects, as FSDP2 does, the
      optimizer is pointed at them, in any order and any split of ``prepare``
      calls); state tensors follow their parameter's device.
    * LR scheduler: returned as is; it advances once per ``scheduler.step()``.
    * ``DataLoader``: rebuilt as a :class:`PreparedLoader` that reads this
      rank's shard (see :class:`Sharding`) with the same batch size per process,
      and delivers batches on ``dist.device``. Any sampler (its output for the
      epoch, drawn from ``(dist.seed, epoch)``, is dealt to the ranks), any batch
      sampler (its batches are dealt whole) and ``batch_size=None`` (each item
      is a batch, dealt whole) work; a ``DistributedSampler`` or a sampler with
      hidden random state is refused (docs/data.md).
    * Already prepared objects come back unchanged (prepared for another
      ``DistState``: :class:`~faccel.errors.PrepareError`).

    With more than one process, the ranks first check that each was given the
    same set-up (models' parameter and buffer names, shapes and dtypes, on meta
    too; optimizer groups; loader lengths and batch sizes; the ``DistState``;
    the kinds of the objects), by one small ``all_gather`` of digests, before
    anything is wrapped: a difference is a
    :class:`~faccel.errors.SetupMismatchError` on every rank naming the rank
    and the first item. Every rank must make the same ``prepare`` calls.

    Args:
        dist: The run's :class:`DistState`.
        *objs: The objects to prepare, in any order.
        even_batches: Pad the last batches (repeating the fewest samples) so that
            every rank sees the same number of batches; without it, ranks may
            differ by one batch, which can hang DDP.
        ddp_kwargs: Keyword arguments for ``DistributedDataParallel``.
        shard_policy: Under ``strategy='fsdp'``: which submodules become FSDP2
            units (``fully_shard`` is applied to each, innermost first, then to
            the root). Default: each block of the first ``ModuleList``, else
            each child module with parameters, less those that would split a
            tied parameter over two units (docs/large-models.md).
        split_batches: The loader's ``batch_size`` is the *global* batch: each
            rank takes ``batch_size // world_size`` of every global batch (it must
            divide), so the global batch stays fixed as the world size changes.
        worker_seeds: How loader workers are seeded. ``'rank'`` (default): each
            batch's random numbers (augmentations) follow ``(dist.seed, epoch,
            rank, batch)``, so ranks draw different numbers and a resumed run
            the same as the straight one; ``'shared'``: the same without the
            rank (every rank draws the same numbers); ``'torch'``: only the
            DataLoader's own per-worker seeding, from ``(dist.seed, epoch, start)``.
        tp_plan: Under a layout with tensor parallelism (``dist.parallel.tensor
            > 1``): how to split the model's layers, as PyTorch's
            ``parallelize_module`` takes it: ``{"mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel()}``, keys as in ``named_modules()``
            with ``*`` for any one name. Applied first, then FSDP2 shards over
            the data-parallel ranks (docs/parallelism.md). Unused when the
            layout has no tensor parallelism, so one script runs on any layout.
        init: For a model built under ``torch.device("meta")`` (docs/large-models.md):
            it is sharded first, then only this rank's shards are allocated on
            ``dist.device`` and initialized. ``'reset'`` (default): each module's
            ``reset_parameters()`` in registration order, bitwise the eager
            build after the same ``torch.manual_seed`` at any world size and
            layout; ``'empty'``: allocated only, for a ``load_model`` that
            follows; a callable ``init(module)``: run on each module that owns
            meta tensors, with those tensors whole and plain on the CPU (twice,
            from the same generator state, where the module owns integer or bool
            tensors: what it left unset differs between the two). Unused
            for a model that is not on meta. (Under DeepSpeed the meta model is
            materialized whole, as under DDP, before the engine partitions it.)
        activation_checkpointing: Which submodules recompute their activations in
            the backward instead of keeping them (docs/large-models.md): a module
            class (``Block``), a tuple of classes, or a predicate ``fn(module) ->
            bool``; the outermost matches are taken. Each keeps its class,
            parameters and ``state_dict`` keys; its forward runs through
            ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with the RNG
            state preserved, so dropout masks and gradients are bitwise those of
            the run without it. Applied before DDP, FSDP2 or tensor parallelism
            wrap the model. Default: none.
        offload: Under FSDP2: ``'cpu'`` keeps the sharded parameters, their
            gradients and the optimizer step on the CPU (FSDP2's
            ``CPUOffloadPolicy``), copying each unit to the device for its forward
            and backward. Default ``None``: everything on ``dist.device``.
        reshard_after_forward: Under FSDP2: free each unit's gathered parameters
            after its forward and gather them again for the backward (``True``,
            default: less memory), or keep them until the backward (``False``:
            one all-gather fewer per unit and step). The gradients are the same
            either way. FSDP2's mixed precision needs no option: it follows
            ``dist.precision`` (parameters gathered in bf16/fp16, gradients
            reduced in float32, the sharded parameters kept in float32).
        split: Under a layout with pipeline stages (``dist.parallel.pipeline >
            1``): where the model is cut, as module names where a new stage
            begins (``("layers.4", "layers.8")``: torch's tracer
            ``torch.distributed.pipelining.pipeline``, which keeps the original
            parameter names), or a function ``build(stage, stages) -> nn.Module``
            that builds one stage. The model comes back as a
            ``PipelinedModel``; train it with :func:`forward_backward`
            (docs/parallelism.md). Unused without pipeline stages, so one script
            runs on any layout.
        schedule: The pipeline schedule, a :class:`Schedule` (default: 1F1B,
            one micro-batch per stage).
        example: Under pipeline stages: a batch of inputs as this rank's
            :func:`forward_backward` will get it (a tensor or a tuple); the
            stages are built now from its shapes, instead of at the first
            ``forward_backward``, so that ``restore`` (or ``load_model``) can
            fill them before training. Unused without pipeline stages.
        comm_hook: Under DDP: compress the gradients DDP all-reduces with one
            of torch's communication hooks, ``'fp16'``, ``'bf16'``,
            ``'powersgd'`` or ``'batched_powersgd'`` (Accelerate's
            ``DistributedDataParallelKwargs(comm_hook=...)``). In one process
            (no DDP wrapper) nothing is registered. ``'bf16'`` needs NCCL
            (torch's rule; refused by name on gloo). Default: none.
        comm_hook_options: For the PowerSGD hooks: ``PowerSGDState``'s keywords
            (``matrix_approximation_rank``, ``start_powerSGD_iter``, ...) and
            ``wrapper='fp16'`` or ``'bf16'`` to compress PowerSGD's own traffic
            (Accelerate's ``comm_state_option`` and ``comm_wrapper``).
        experts: Under a layout with expert ranks (``dist.parallel.expert > 1``):
            the names of the model's experts modules (as in ``named_modules()``),
            where faccel's search for them finds none; default: every module
            that meets the experts contract (docs/parallelism.md, "Mixture of
            experts": transformers' ``MixtralExperts``, ``Qwen2MoeExperts``...).
            Each rank keeps its block of each one's experts; tokens travel to
            them by all-to-all. ``Layout(expert=E)`` over every rank (DDP for the
            rest), and under FSDP2 beside ``shard``, ``replicate``, ``tensor`` and
            ``pipeline`` (stages built by a ``split=`` function). Given in
            one process, the same dispatch runs with every expert here (the same
            forward at any size).
        expert_capacity: Each expert's capacity per batch, as a multiple of its
            even share of the assignments (``ceil(c * tokens * k / experts)``
            on each rank); the assignments past it are dropped (their output
            is zero) and counted (:func:`expert_load`). Default ``None``:
            dropless.

    Returns:
        The prepared objects in the given order (one object: itself).

    Raises:
        PrepareError: A loader faccel cannot shard (a ``DistributedSampler``, a
            sampler with hidden state, ``split_batches`` with a batch size the
            world size does not divide), an object prepared for another
            ``DistState``, one of the refused objects above, or a layout with
            tensor parallelism and no ``tp_plan`` (or a plan key that names no
            submodule); a model partly on the meta device, or a meta model
            ``init`` cannot fill (a module without ``reset_parameters``, a tensor
            the initializer left unset, of any dtype, a meta non-persistent buffer under
            ``'empty'``, a tie whose owners draw it differently and that the model's
            ``_tied_weights_keys`` does not direct); a ``shard_policy`` that splits a
            tied parameter over two FSDP2 units; a model with no trainable parameter
            under DDP; an ``activation_checkpointing`` that matches no
            submodule; ``offload`` or ``reshard_after_forward=False`` with a
            strategy that does not shard with FSDP2 (DDP, DeepSpeed), or
            ``activation_checkpointing`` under DeepSpeed (not applied to its engine).
        SetupMismatchError: The ranks were not given the same set-up: a model,
            optimizer, loader or ``DistState`` that differs on some rank, or
            another number or kind of objects; raised on every rank, naming the
            rank and the first item that differs, before anything is wrapped.
        ArgumentError: ``activation_checkpointing`` is not a class, a tuple or a
            callable (the type check names the argument).
        ArgumentValueError: ``activation_checkpointing`` is a class that is not an
            ``nn.Module`` or a tuple of something else (or empty); ``offload`` is not ``None`` or ``'cpu'``;
            ``init`` is not ``'reset'``, ``'empty'`` or a callable;
            ``worker_seeds`` is not ``'rank'``, ``'shared'`` or ``'torch'``.

    Example:
        >>> import torch, faccel
        >>> dist = faccel.detect({})
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> data = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.randn(10, 1))
        >>> loader = torch.utils.data.DataLoader(data, batch_size=4)
        >>> model, optimizer, loader, tag = faccel.prepare(dist, model, optimizer, loader, "tag")
        >>> (len(loader), loader.batch_size, tag)
        (3, 4, 'tag')
    """
    breadcrumb(dist, "prepare")  # what this rank was last doing, should a peer's collective time out
    options = PrepareOptions(
        init=init,
        even_batches=even_batches,
        ddp_kwargs=ddp_kwargs,
        shard_policy=shard_policy,
        split_batches=split_batches,
        worker_seeds=worker_seeds,
        tp_plan=tp_plan,
        activation_checkpointing=activation_checkpointing,
        offload=offload,
        reshard_after_forward=reshard_after_forward,
        split=tuple(split) if isinstance(split, list | tuple) else split,
        schedule=schedule,
        example=example,
        comm_hook=comm_hook,
        comm_hook_options=comm_hook_options,
        experts=tuple(experts) if experts is not None else None,
        expert_capacity=expert_capacity,
    )
    strategy = loop_strategy(dist)  # the run's strategy, chosen once (faccel._loop._strategies)
    strategy.check_options(dist, options)
    check_context(dist)  # context parallelism only where torch has ring attention (faccel._loop._context)
    # Every rank was given the same set-up (one small all_gather), before anything is wrapped or sharded.
    check_setup(dist, objs, options)
    if strategy.whole_model:  # a meta-built model made real and whole before the strategy takes it
        _materialize_whole(dist, objs, options)
    prepared = strategy.prepare(dist, objs, lambda obj: _prepare_one(dist, obj, options))
    if len(prepared) == 1:
        return prepared[0]
    return prepared
