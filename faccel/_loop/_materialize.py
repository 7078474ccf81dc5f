"""Meta-built models made real: only this rank's shards allocated, initialized as the eager build.

A model built under ``torch.device("meta")`` has shapes and no storage. ``prepare``
shards it first (FSDP2, HSDP, tensor parallelism: they all accept meta
parameters), then :func:`materialize` allocates what this rank holds on its
device (``Module.to_empty``: FSDP2 and DTensor parameters get local shards only)
and initializes it one module at a time:

* each module that owns meta tensors gets *whole, plain* CPU stand-ins for them
  (a shadow): floating and complex ones filled with NaN, the others (integers,
  bool) with a bit pattern;
* the initializer runs on the module (``reset_parameters()``, or the user's
  callable), drawing from torch's default CPU generator exactly as the eager
  build's constructors did, in registration order;
* every NaN stand-in must now hold no NaN; a module that owns other dtypes is
  initialized a second time from the same generator state, into stand-ins of
  the complementary pattern, and the two results must be equal bit for bit (so
  an element left unset, or read before it was written, is caught exactly,
  with no value reserved); a tensor left unset, of any dtype, is refused by
  name. Each rank keeps its own rows of it (``distribute_tensor`` with
  ``src_data_rank=None``: a local slice, no communication) and drops the rest.

So the extra memory is the largest module's own tensors, and the weights are
bitwise those of the eager build after the same ``torch.manual_seed``, at any
world size and layout (docs/large-models.md says which models that covers).
A tensor several modules share (tied weights, a shared buffer) stays one
tensor, with the values of the owner it was tied from (``faccel._loop._ties``):
every owner draws, in registration order, as the eager constructors did, and
the other owners' draws are thrown away as the eager build's were.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from faccel._dist._dtensor import copy_box
from faccel._loop._ties import declared_sources, full_name, owners
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
    return bool(meta or meta_buffers)


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
    whole and plain on the CPU. A tensor several modules share (tied weights,
    a shared buffer) stays one tensor.

    Raises:
        PrepareError: The initializer left a tensor (partly) unset, of any
            dtype; replaced one with a tensor of another shape or dtype; or,
            under ``'reset'``, the owners of a tied tensor drew it differently
            and the model does not say which one it was tied from.

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
    shared = [group for group in owners(model).values() if len(group) > 1]
    model.to_empty(device=device)
    # to_empty makes a new tensor per owner where it cannot swap in place (buffers, some
    # parameters): the first owner's is set on the others, one tensor again.
    for (_, first, first_kind, first_name), *others in shared:
        tensor = _dict(first, first_kind)[first_name]
        for _, module, kind, name in others:
            _dict(module, kind)[name] = tensor
    with torch.no_grad():
        for module, name, buffer in kept:
            module_dicts(module)[2][name].copy_(buffer)  # type: ignore[union-attr]
    run: Callable[[nn.Module], None] = init if callable(init) else _reset
    ties = _Ties(model, compare=not callable(init))
    with torch.no_grad():
        for path, module in model.named_modules():
            names = pending.get(id(module), [])
            # Under 'empty' only the tensors no state dict holds are computed (and kept).
            keep = computed_buffers.get(id(module), []) if init == "empty" else names
            if keep:
                _initialize(module, path, names, run, ties, keep)


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


def _dict(module: nn.Module, kind: str) -> dict[str, Any]:
    return module_dicts(module)[1] if kind == "parameter" else module_dicts(module)[2]


def _slot(module: nn.Module, name: str) -> dict[str, Any]:
    return module_dicts(module)[1] if name in module_dicts(module)[1] else module_dicts(module)[2]


# The dtypes a NaN marks as unset. Every other dtype (integers, bool, float8) is drawn twice
# from the same generator state into stand-ins whose every bit differs (0xA5.., then 0x5A..;
# False, then True): an element the initializer wrote alone is equal in both, one it left or
# read before writing is not. Exact, with no value reserved as a sentinel.
_NAN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)
_PATTERNS = (0xA5, 0x5A)


def _stand_in(tensor: torch.Tensor, draw: int) -> torch.Tensor:
    """A whole, plain CPU tensor like ``tensor``: NaN, or (other dtypes) the ``draw``-th bit pattern."""
    shadow = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    if tensor.dtype in _NAN_DTYPES:  # both parts of a complex one: writing the real parts is not enough
        shadow.fill_(complex(float("nan"), float("nan")) if tensor.is_complex() else float("nan"))
    elif tensor.dtype == torch.bool:
        shadow.fill_(draw == 1)
    elif shadow.numel():
        shadow.view(-1).view(torch.uint8).fill_(_PATTERNS[draw])
    return shadow


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes, one row per element: compared bitwise whatever the dtype."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), tensor.element_size())


def _digest(tensor: torch.Tensor) -> bytes:
    return hashlib.blake2b(_bytes(tensor).numpy().data, digest_size=16).digest()


class _Ties:
    """Which owner's draw of each shared tensor is kept, and the check of the others' draws.

    A tensor one module owns is kept from its draw. A shared one is kept from
    the owner the model's ``_tied_weights_keys`` says it was tied from; when
    none says, from its first owner, and under ``'reset'`` every later owner's
    draw must equal it bitwise (a shared table computed alike), since the
    eager build kept the draw of an owner the built model does not name.
    """

    def __init__(self, model: nn.Module, *, compare: bool) -> None:
        self.compare = compare
        self.owners: dict[int, list[str]] = {}
        for key, group in owners(model).items():
            self.owners[key] = [full_name(path, name) for path, _, _, name in group]
        declared = declared_sources(model)
        self.source: dict[int, str] = {}
        for key, names in self.owners.items():
            sources = {declared[name] for name in names if declared.get(name) in names}
            if len(names) > 1 and len(sources) == 1:
                self.source[key] = sources.pop()
        self.kept: dict[int, bytes | None] = {}

    def action(self, tensor: torch.Tensor, name: str) -> str:
        """``'keep'`` this owner's draw, ``'compare'`` it with the kept one, or ``'drop'`` it."""
        key = id(tensor)
        if key in self.source:
            return "keep" if name == self.source[key] else "drop"
        if key not in self.kept:
            return "keep"
        return "compare" if self.compare and self.kept[key] is not None else "drop"

    def keep(self, tensor: torch.Tensor, whole: torch.Tensor) -> None:
        shared = len(self.owners.get(id(tensor), ())) > 1
        compared = self.compare and shared and id(tensor) not in self.source
        self.kept[id(tensor)] = _digest(whole) if compared else None

    def check(self, tensor: torch.Tensor, whole: torch.Tensor, where: str, name: str) -> None:
        if _digest(whole) == self.kept[id(tensor)]:
            return
        names = self.owners[id(tensor)]
        first, this = names[0], name
        msg = (
            f"initializing {where} drew {this!r} differently from {first!r}, which is the same "
            f"tensor (tied: {', '.join(names)}); the eager build keeps the draw of the module it was "
            "tied from, and a built model does not record which way the tie was assigned. Say it on "
            f"the model's class, as Hugging Face models do (tied name -> the name it is tied from): "
            f"_tied_weights_keys = {{{first!r}: {this!r}}} for self.{first} = self.{this}, or "
            f"{{{this!r}: {first!r}}} for self.{this} = self.{first}; or pass init='empty' and load "
            "the weights with faccel.load_model"
        )
        raise PrepareError(msg)


def _draw(
    module: nn.Module, real: dict[str, torch.Tensor], run: Callable[[nn.Module], None], draw: int
) -> dict[str, Any]:
    """Run ``run`` on ``module`` with stand-ins for ``real``; what each slot holds after (real put back).

    A tensor the module holds under two names gets one stand-in under both, as in the eager build.
    """
    shadows: dict[int, torch.Tensor] = {}
    for name, tensor in real.items():
        if id(tensor) not in shadows:
            shadow = _stand_in(tensor, draw)
            if isinstance(tensor, nn.Parameter):
                shadow = nn.Parameter(shadow, requires_grad=tensor.requires_grad)
            shadows[id(tensor)] = shadow
        _slot(module, name)[name] = shadows[id(tensor)]
    try:
        run(module)
        return {name: _slot(module, name).get(name) for name in real}
    finally:
        for name, tensor in real.items():
            _slot(module, name)[name] = tensor


def _initialize(
    module: nn.Module,
    path: str,
    names: list[str],
    run: Callable[[nn.Module], None],
    ties: _Ties,
    keep: list[str],
) -> None:
    """Run ``run`` on ``module`` with whole CPU stand-ins for ``names``; keep this rank's rows of ``keep``."""
    where = f"{path or '<root>'} ({type(module).__name__})"
    real: dict[str, torch.Tensor] = {name: _slot(module, name)[name] for name in names}
    actions = {name: ties.action(real[name], full_name(path, name)) for name in names if name in keep}
    exact = [
        name for name, action in actions.items() if action != "drop" and real[name].dtype not in _NAN_DTYPES
    ]
    state = torch.get_rng_state() if exact else None
    wholes = _draw(module, real, run, 0)
    first: dict[str, Any] = {}
    if state is not None:  # the second draw, from the same generator state (it ends where the first did)
        first = {name: wholes[name] for name in exact}
        torch.set_rng_state(state)
        wholes = _draw(module, real, run, 1)
    for name, action in actions.items():
        if action == "drop":  # tied: a throwaway draw, as the eager build's was
            continue
        whole = _checked(wholes[name], real[name], where, name)
        unset = (
            bool(torch.isnan(whole).any())
            if whole.dtype in _NAN_DTYPES
            else not torch.equal(_bytes(_checked(first[name], real[name], where, name)), _bytes(whole))
        )
        if unset:
            msg = (
                f"initializing {where} left {name!r} unset (where the initializer wrote nothing, or "
                "read what was there before writing); its reset_parameters() (or your init) must fill "
                "every tensor the module owns, of every dtype, as its constructor does, or pass "
                "init='empty' and load_model"
            )
            raise PrepareError(msg)
        if action == "compare":
            ties.check(real[name], whole, where, full_name(path, name))
            continue
        ties.keep(real[name], whole)
        copy_box(whole.detach(), real[name])


def _checked(whole: Any, tensor: torch.Tensor, where: str, name: str) -> torch.Tensor:
    """What the initializer left in ``name``'s slot: a tensor of ``tensor``'s shape and dtype."""
    if not isinstance(whole, torch.Tensor) or whole.shape != tensor.shape or whole.dtype != tensor.dtype:
        got = (
            f"a tensor of shape {list(whole.shape)} and {whole.dtype}"
            if isinstance(whole, torch.Tensor)
            else repr(whole)
        )
        msg = (
            f"initializing {where} replaced {name!r} with {got}; the module's is of shape "
            f"{list(tensor.shape)} and {tensor.dtype}: fill it in place, or assign one of that shape "
            "and dtype"
        )
        raise PrepareError(msg)
    return whole
