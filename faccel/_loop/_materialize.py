"""Meta-built models made real: only this rank's shards allocated, initialized as the eager build.

A model built under ``torch.device("meta")`` has shapes and no storage. ``prepare``
shards it first (FSDP2, HSDP, tensor parallelism: they all accept meta
parameters), then :func:`materialize` allocates what this rank holds on its
device (``Module.to_empty``: FSDP2 and DTensor parameters get local shards only)
and initializes it one module at a time:

* each module that owns meta tensors gets *whole, plain* CPU stand-ins for them
  (a shadow), filled with NaN;
* the initializer runs on the module (``reset_parameters()``, or the user's
  callable), drawing from torch's default CPU generator exactly as the eager
  build's constructors did, in registration order;
* every floating stand-in must now hold no NaN (a tensor left unset is refused
  by name); each rank keeps its own rows of it (``distribute_tensor`` with
  ``src_data_rank=None``: a local slice, no communication) and drops the rest.

So the extra memory is the largest module's own tensors, and the weights are
bitwise those of the eager build after the same ``torch.manual_seed``, at any
world size and layout (docs/large-models.md says which models that covers).
A tensor two modules share (tied weights) keeps the first owner's values; a
later owner draws into a throwaway stand-in, as its constructor's values were
thrown away when the eager build tied them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from faccel._dist._dtensor import copy_box
from faccel._torch_compat import module_dicts, non_persistent_buffers
from faccel.errors import ArgumentValueError, PrepareError

__all__ = ["INITS", "check_init", "is_meta_model", "materialize", "prepare_meta"]

Init = str | Callable[[nn.Module], None]
# What ``prepare(init=...)`` takes besides a callable.
INITS = ("reset", "empty")


def _tensors(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(kind, name, tensor)`` of the tensors ``module`` itself owns (not its children's)."""
    for name, param in module_dicts(module)[1].items():
        if param is not None:
            yield "parameter", name, param
    for name, buffer in module_dicts(module)[2].items():
        if buffer is not None:
            yield "buffer", name, buffer


def is_meta_model(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are all on the meta device (built under ``torch.device("meta")``).

    Buffers made outside meta (a rotary table built on the CPU) may stay real:
    they are kept as they are. A model with parameters on meta and elsewhere,
    or with real parameters and meta buffers, is refused.

    Raises:
        PrepareError: Some of ``model``'s tensors are on meta and some parameters are not.

    Example:
        >>> import torch
        >>> with torch.device("meta"):
        ...     net = torch.nn.Linear(2, 1)
        >>> is_meta_model(net), is_meta_model(torch.nn.Linear(2, 1))
        (True, False)
    """
    meta: list[str] = []
    real: list[str] = []
    for name, param in model.named_parameters():
        (meta if param.is_meta else real).append(name)
    meta_buffers = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if (meta or meta_buffers) and real:
        where = f"parameter {meta[0]!r}" if meta else f"buffer {meta_buffers[0]!r}"
        msg = (
            f"the {type(model).__name__} is partly on the meta device: {where} is on meta, "
            f"parameter {real[0]!r} is on {model.get_parameter(real[0]).device} "
            f"({len(meta)} of {len(meta) + len(real)} parameters on meta); prepare materializes a "
            "model built wholly under torch.device('meta') (or takes a real one): build all of it "
            "on meta, or all of it for real"
        )
        raise PrepareError(msg)
    return bool(meta)


def check_init(model: nn.Module, init: Init) -> None:
    """Refuse, before any sharding, an ``init`` that cannot initialize ``model``'s meta tensors.

    Raises:
        ArgumentValueError: ``init`` is not ``'reset'``, ``'empty'`` or a callable.
        PrepareError: Under ``'reset'``, a module that owns meta tensors has no
            ``reset_parameters``; under ``'empty'``, a non-persistent buffer is on
            meta (no ``load_model`` can fill it).

    Example:
        >>> import torch
        >>> with torch.device("meta"):
        ...     net = torch.nn.Linear(2, 1)
        >>> check_init(net, "reset")
        >>> check_init(net, "zeros")
        Traceback (most recent call last):
        ...
        faccel.errors.ArgumentValueError: init must be 'reset', 'empty' or a callable init(module), ...
    """
    if not callable(init) and init not in INITS:
        msg = f"init must be 'reset', 'empty' or a callable init(module), got {init!r}"
        raise ArgumentValueError(msg)
    for path, module in model.named_modules():
        owned = [(kind, name) for kind, name, tensor in _tensors(module) if tensor.is_meta]
        if not owned:
            continue
        where = f"{path or '<root>'} ({type(module).__name__})"
        if init == "reset" and not callable(getattr(module, "reset_parameters", None)):
            kind, name = owned[0]
            msg = (
                f"init='reset' calls each module's reset_parameters(), but {where} has none and owns "
                f"the meta {kind} {name!r}; give the module a reset_parameters() that fills its own "
                "tensors as its constructor does, pass init=callable (run on each module, its own "
                "tensors whole), or init='empty' and load the weights with faccel.load_model"
            )
            raise PrepareError(msg)
        if init == "empty" and _computed(module) and not callable(getattr(module, "reset_parameters", None)):
            name = _computed(module)[0]
            msg = (
                f"init='empty' leaves tensors for load_model to fill, but the non-persistent buffer "
                f"{name!r} of {where} is on meta and is in no state dict, and the module has no "
                "reset_parameters() to compute it; give it one, or build that module's buffers "
                "outside meta (with torch.device('cpu'): ...)"
            )
            raise PrepareError(msg)


def _computed(module: nn.Module) -> list[str]:
    """The meta non-persistent buffers ``module`` owns: computed, never loaded (rotary tables, masks)."""
    return [
        name
        for name, buffer in module_dicts(module)[2].items()
        if buffer is not None and buffer.is_meta and name in non_persistent_buffers(module)
    ]


def materialize(model: nn.Module, device: torch.device, init: Init) -> None:
    """Allocate ``model``'s meta tensors on ``device`` (this rank's shards only), initialized, in place.

    Real buffers of the meta-built model keep their values. ``init`` as in
    ``prepare``: ``'reset'``, ``'empty'`` (allocated, not initialized, except
    the meta non-persistent buffers, which no state dict holds: their module's
    ``reset_parameters()`` computes them, its other tensors are left) or a
    callable run on each module that owns meta tensors, with those tensors
    whole and plain on the CPU.

    Raises:
        PrepareError: The initializer left a floating tensor (partly) unset.

    Example:
        >>> import torch
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> eager = torch.nn.Linear(3, 2)
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> with torch.device("meta"):
        ...     net = torch.nn.Linear(3, 2)
        >>> materialize(net, torch.device("cpu"), "reset")
        >>> torch.equal(net.weight, eager.weight), torch.equal(net.bias, eager.bias)
        (True, True)
    """
    kept = [
        (module, name, buffer)
        for module in model.modules()
        for kind, name, buffer in _tensors(module)
        if kind == "buffer" and not buffer.is_meta
    ]
    pending = {
        id(module): [name for kind, name, tensor in _tensors(module) if tensor.is_meta]
        for module in model.modules()
    }
    computed_buffers = {id(module): _computed(module) for module in model.modules()}
    owners = [
        (module, name, id(tensor))
        for module in model.modules()
        for kind, name, tensor in _tensors(module)
        if kind == "parameter"
    ]
    model.to_empty(device=device)
    # to_empty makes a new Parameter per owner where it cannot swap in place: tie them again.
    first: dict[int, nn.Parameter] = {}
    for module, name, key in owners:
        param = module_dicts(module)[1][name]
        if param is not None:
            module_dicts(module)[1][name] = first.setdefault(key, param)
    with torch.no_grad():
        for module, name, buffer in kept:
            module_dicts(module)[2][name].copy_(buffer)  # type: ignore[union-attr]
    run: Callable[[nn.Module], None] = init if callable(init) else _reset
    done: set[int] = set()
    with torch.no_grad():
        for path, module in model.named_modules():
            names = pending.get(id(module), [])
            # Under 'empty' only the tensors no state dict holds are computed (and kept).
            keep = computed_buffers.get(id(module), []) if init == "empty" else names
            if keep:
                _initialize(module, path, names, run, done, keep)


def prepare_meta(model: nn.Module, device: torch.device, init: Init, *, shards_first: bool) -> bool:
    """Whether ``model`` is meta-built; if so, checked, and materialized now unless it is sharded first.

    A model that will be sharded (FSDP2, HSDP, tensor parallelism) is
    materialized after the sharding, by the caller; any other (one process,
    DDP) is materialized whole here, before it is wrapped.

    Raises:
        PrepareError: As :func:`is_meta_model` and :func:`check_init`.
        ArgumentValueError: As :func:`check_init`.

    Example:
        >>> import torch
        >>> with torch.device("meta"):
        ...     net = torch.nn.Linear(2, 1)
        >>> prepare_meta(net, torch.device("cpu"), "reset", shards_first=False), net.weight.device
        (True, device(type='cpu'))
    """
    if not is_meta_model(model):
        return False
    check_init(model, init)
    if not shards_first:
        materialize(model, device, init)
    return True


def _reset(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def _slot(module: nn.Module, name: str) -> dict[str, Any]:
    return module_dicts(module)[1] if name in module_dicts(module)[1] else module_dicts(module)[2]


def _initialize(
    module: nn.Module,
    path: str,
    names: list[str],
    run: Callable[[nn.Module], None],
    done: set[int],
    keep: list[str],
) -> None:
    """Run ``run`` on ``module`` with whole CPU stand-ins for ``names``; keep this rank's rows of ``keep``."""
    real: dict[str, torch.Tensor] = {name: _slot(module, name)[name] for name in names}
    for name, tensor in real.items():
        shadow = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        if shadow.is_floating_point():
            shadow.fill_(float("nan"))
        if isinstance(tensor, nn.Parameter):
            module_dicts(module)[1][name] = nn.Parameter(shadow, requires_grad=tensor.requires_grad)
        else:
            module_dicts(module)[2][name] = shadow
    try:
        run(module)
        for name, tensor in real.items():
            whole = _slot(module, name)[name]
            if name not in keep or id(tensor) in done:  # tied: a throwaway draw, as the eager build's was
                continue
            if whole.is_floating_point() and bool(torch.isnan(whole).any()):
                msg = (
                    f"initializing {path or '<root>'} ({type(module).__name__}) left {name!r} unset "
                    "(NaN where the initializer wrote nothing); its reset_parameters() (or your init) "
                    "must fill every tensor the module owns, or pass init='empty' and load_model"
                )
                raise PrepareError(msg)
            copy_box(whole.detach(), tensor)
            done.add(id(tensor))
    finally:
        for name, tensor in real.items():
            _slot(module, name)[name] = tensor
