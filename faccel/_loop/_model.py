"""Models: moved, wrapped for precision and DDP, and unwrapped again.

The user's module's methods are never replaced: precision comes from a thin
outer module whose forward runs the user's forward under autocast, and DDP
wraps that. Two marks are set on a prepared module (the wrapper it got, and
whether faccel split it for tensor parallelism), one on a DDP wrapper (its
process group, pinned past its reducer), and a sharded model gets the
evaluation check-in hook (``faccel._loop._check_in``), all listed with why in
``faccel._marks``. ``unwrap_model`` peels every layer faccel (or torch.compile) added.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from faccel._dist._mesh import data_mesh
from faccel._dist._process_group import pin_process_group
from faccel._dist._state import DistState
from faccel._loop._activation_checkpoint import checkpoint_activations
from faccel._loop._check_in import add_check_in
from faccel._loop._materialize import materialize, prepare_meta
from faccel._loop._options import PrepareOptions
from faccel._loop._strategies._deepspeed._engine import is_deepspeed_engine
from faccel._loop._strategies._mesh._tp_plan import apply_plan, plan_key_matches
from faccel._loop._ties import check_ties_in_plan, check_ties_in_units, ties_in_one_unit
from faccel._marks import TENSOR_PARALLEL, WRAPPED_AS
from faccel._torch_compat import compiled_original, rebuild_ddp_buckets
from faccel._tree import map_tensors
from faccel.errors import PrepareError

__all__ = [
    "Autocast",
    "check_options",
    "default_shard_policy",
    "is_sharded",
    "prepare_module",
    "shards_with_fsdp",
    "unwrap_model",
    "uses_mesh",
]


def float32_outputs(tree: Any) -> Any:
    """``tree`` with its float16 and bfloat16 tensors cast to float32 (outputs of an autocast forward)."""
    return map_tensors(_float32, tree)


def _float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


class Autocast(nn.Module):
    """Runs ``module``'s forward under ``torch.autocast`` and returns float32 outputs.

    Float32 outputs keep the loss, computed outside the model, in full
    precision, as with hand-written autocast code.
    """

    def __init__(self, module: nn.Module, *, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            out = self.module(*args, **kwargs)
        return float32_outputs(out)


# Layers that wrap a module and keep it in an attribute: peeled by unwrap_model.
_WRAPPERS: tuple[tuple[type, str], ...] = (
    (DistributedDataParallel, "module"),
    (Autocast, "module"),
)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside every wrapper that ``prepare`` (or ``torch.compile``) added.

    A DeepSpeed engine gives its module (under ZeRO-3 its parameters are
    partitioned: save it with :func:`faccel.save_model`, which gathers them).

    Example:
        >>> import torch, faccel
        >>> net = torch.nn.Linear(2, 1)
        >>> dist = faccel.DistState.simulated(precision="bf16")
        >>> faccel.unwrap_model(faccel.prepare(dist, net)) is net
        True
    """
    while True:
        for kind, attribute in _WRAPPERS:
            if isinstance(model, kind):
                model = getattr(model, attribute)
                break
        else:
            original = compiled_original(model)  # torch.compile's OptimizedModule
            if is_deepspeed_engine(model):
                original = model.module  # type: ignore[assignment]  # an engine holds an nn.Module
            if original is not None:
                model = original
                continue
            return model


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


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors faccel made: FSDP2's ``fully_shard`` or tensor parallelism.

    Such a model is saved and restored through the whole-state collectives,
    not its own ``state_dict`` (which holds each rank's pieces).
    """
    # Looked up on the class: Module.__getattr__ would build an error message per miss.
    kind = type(model)
    return (hasattr(kind, "set_requires_gradient_sync") and hasattr(kind, "reshard")) or (
        _TENSOR_PARALLEL in model.__dict__
    )


def uses_mesh(dist: DistState) -> bool:
    """Whether ``dist``'s layout needs the DeviceMesh: tensor parallelism, or FSDP2 with replicas (HSDP).

    The layouts every strategy had before layouts existed (DDP over all
    ranks, FSDP2 over all ranks) keep their own path.
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
    """
    return dist.strategy == "fsdp" or (uses_mesh(dist) and dist.parallel.data_size > 1)


def check_options(dist: DistState, options: PrepareOptions) -> None:
    """Refuse the options ``dist``'s strategy has no use for, by name.

    Raises:
        PrepareError: ``offload`` or ``reshard_after_forward=False`` without FSDP2
            (DDP, DeepSpeed), or ``activation_checkpointing`` under DeepSpeed.
    """
    if dist.strategy == "deepspeed" and options.activation_checkpointing is not None:
        msg = (
            "under strategy='deepspeed' the model goes to DeepSpeed's engine, and faccel's "
            "activation_checkpointing is not applied there (ZeRO partitions the parameters its way); "
            "call torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) in your forward "
            "(or transformers' model.gradient_checkpointing_enable()), or use strategy='fsdp'"
        )
        raise PrepareError(msg)
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


ShardPolicy = Callable[[nn.Module], bool]


def default_shard_policy(root: nn.Module) -> ShardPolicy:
    """Shard each block of the first ``ModuleList`` (transformer layers), else each child.

    Each block becomes one FSDP2 unit: its parameters are gathered just before
    its forward and freed after, which is what bounds the peak memory. A
    module that shares a parameter with one outside it (a tied embedding and
    head) is left to the unit around both, so the tied tensor is sharded once.
    """
    blocks = next((m for m in root.modules() if isinstance(m, nn.ModuleList)), None)
    units = {id(m) for m in (blocks if blocks is not None else root.children())}
    return ties_in_one_unit(
        root, lambda module: id(module) in units and any(True for _ in module.parameters())
    )


def _wrap_ddp(dist: DistState, model: nn.Module, options: PrepareOptions) -> nn.Module:
    wrapped: nn.Module = model
    if dist.autocast_dtype is not None:
        wrapped = Autocast(model, device_type=dist.device.type, dtype=dist.autocast_dtype)
    if dist.distributed:
        if not any(param.requires_grad for param in model.parameters()):
            msg = (
                f"the {type(model).__name__} has no parameter that requires a gradient, so DDP has "
                "nothing to train or average (torch's DistributedDataParallel refuses it); prepare the "
                "model that trains, and build one of buffers only on dist.device, unprepared"
            )
            raise PrepareError(msg)
        device_ids = [dist.device.index] if dist.device.type == "cuda" else None
        ddp = DistributedDataParallel(wrapped, device_ids=device_ids, **dict(options.ddp_kwargs or {}))
        if dist.world_size > 2:
            _fix_bucket_layout(ddp)
        pin_process_group(ddp)  # freeing it after shutdown must not join gloo's threads (faccel._marks)
        wrapped = ddp
    return wrapped


def _fix_bucket_layout(ddp: DistributedDataParallel) -> None:
    """Give ``ddp`` the gradient buckets it reduces in from its first step on.

    DDP reduces its first step in one bucket of every parameter, then rebuilds
    its buckets in the order gradients became ready. An all-reduce over more
    than two ranks sums each element in an order that depends on where the
    element lies in its bucket, so a freshly built DDP (a resumed job) would
    reduce its first step differently from a job that has been running: the
    weights part in the last bits. Rebuilding here, in parameter order, fixes
    the layout for every step of every job. (With two ranks each element is
    ``a + b`` whatever the layout, so DDP's own bucketing is kept there.)
    Both calls are collectives that every rank makes, as DDP's constructor is.
    A DDP that never rebuilds (``find_unused_parameters=True``) is left as it is.
    """
    rebuild_ddp_buckets(ddp)


def _wrap_fsdp(dist: DistState, model: nn.Module, options: PrepareOptions, mesh: Any = None) -> nn.Module:
    if not dist.distributed:
        return _wrap_ddp(dist, model, options)  # one process: nothing to shard over
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # CPU offload: sharded parameters (and their gradients) live on the CPU, each unit copied to the
    # device for its forward and backward; pinned memory only where there is a device to copy to.
    offload = (
        CPUOffloadPolicy(pin_memory=dist.device.type == "cuda")
        if options.offload == "cpu"
        else OffloadPolicy()
    )
    reshard = options.reshard_after_forward
    dtype = dist.autocast_dtype
    # FSDP2 casts parameters itself (and all-reduces in float32), so no autocast layer.
    reduce_dtype = torch.float32 if dtype is not None else None
    inner = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    # Float32 outputs from the root only: a block that returned float32 would hand the root's
    # own layers (a read-out after the blocks, in low precision) an input of another dtype.
    root = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype, output_dtype=reduce_dtype)
    if options.shard_policy is not None:  # a tie split over two units: refused before anything is sharded
        check_ties_in_units(model, options.shard_policy)
    should_shard = options.shard_policy or default_shard_policy(model)
    # Innermost first: fully_shard on a parent skips parameters its children already own.
    for module in reversed(list(model.modules())):
        if module is not model and should_shard(module):
            fully_shard(
                module, mesh=mesh, mp_policy=inner, reshard_after_forward=reshard, offload_policy=offload
            )
    fully_shard(model, mesh=mesh, mp_policy=root, reshard_after_forward=reshard, offload_policy=offload)
    add_check_in(dist, model, sharding="FSDP2")  # a forward on some ranks only: a named error
    return model


def _wrap_layout(dist: DistState, model: nn.Module, options: PrepareOptions) -> nn.Module:
    """Tensor parallelism from the plan first, then FSDP2 over the data-parallel part of the mesh.

    That order is PyTorch's (and torchtitan's): ``fully_shard`` then shards
    the TP DTensors again over the data-parallel dimensions (2-D parameters).
    """
    layout = dist.parallel
    if layout.tensor > 1:
        if options.tp_plan is not None:  # a tied parameter split apart: refused before anything is split
            check_ties_in_plan(model, options.tp_plan, plan_key_matches)
        apply_plan(dist, model, options.tp_plan)
    if layout.data_size > 1:
        return _wrap_fsdp(dist, model, options, mesh=data_mesh(dist))
    # Tensor parallelism alone: no data-parallel ranks to shard over or average with.
    object.__setattr__(model, _TENSOR_PARALLEL, True)
    add_check_in(dist, model, sharding="tensor-parallel")  # as under FSDP2 (faccel._loop._check_in)
    if dist.autocast_dtype is not None:
        return Autocast(model, device_type=dist.device.type, dtype=dist.autocast_dtype)
    return model


# How each strategy wraps a model that has been moved to its device.
_STRATEGIES: Mapping[str, Callable[[DistState, nn.Module, PrepareOptions], nn.Module]] = {
    "ddp": _wrap_ddp,
    "fsdp": _wrap_fsdp,
}


def prepare_module(dist: DistState, model: nn.Module, options: PrepareOptions) -> nn.Module:
    """Move ``model`` to ``dist.device`` (in place) and wrap it as ``dist.strategy`` says.

    Under ``'fsdp'`` FSDP2's ``fully_shard`` changes the module in place (its
    class and its parameters, which become DTensors); that is FSDP2's design.
    """
    if options.activation_checkpointing is not None:
        # Before sharding, on a first prepare: FSDP2's hooks then run around the recomputed forward.
        # On a module prepared before (its wrapper comes back below) it is added where it is missing:
        # an instance forward inside DDP's or FSDP2's hooks works the same either way.
        checkpoint_activations(unwrap_model(model), options.activation_checkpointing)
    if isinstance(model, DistributedDataParallel | Autocast):
        return _check_prepared(dist, model)
    # The same module prepared again gets the wrapper it got the first time: a second DDP
    # around it would reduce its gradients twice. (A copy of the module carries the weak
    # reference too, hence the check that the wrapper holds this very module.)
    earlier = model.__dict__.get(_WRAPPED_AS)
    wrapper = earlier() if earlier is not None else None
    if wrapper is not None and unwrap_model(wrapper) is model:
        return _check_prepared(dist, wrapper)
    if is_sharded(model):  # after the wrapper: tensor parallelism alone may wear an Autocast
        return model
    # A meta-built model is sharded first, then only this rank's part is allocated (_materialize).
    shards_first = dist.distributed and (uses_mesh(dist) or dist.strategy == "fsdp")
    meta = prepare_meta(model, dist.device, options.init, shards_first=shards_first)
    if not meta:
        model.to(dist.device)  # in place: the optimizer's parameter references stay valid
    wrap = _wrap_layout if dist.distributed and uses_mesh(dist) else _STRATEGIES[dist.strategy]
    wrapped = wrap(dist, model, options)
    if meta and shards_first:
        materialize(model, dist.device, options.init)
    if wrapped is not model:
        # object.__setattr__: nn.Module's own would register the wrapper as a submodule.
        object.__setattr__(model, _WRAPPED_AS, weakref.ref(wrapped))
    return wrapped


# Set on a module whose layers faccel split over the "tensor" dimension without FSDP2
# (tensor parallelism alone): its parameters are DTensors all the same. See faccel._marks.
_TENSOR_PARALLEL = TENSOR_PARALLEL
_WRAPPED_AS = WRAPPED_AS
