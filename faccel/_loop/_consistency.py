"""Set-up consistency at ``prepare``: every rank was given the same objects, or every rank says which differ.

A model one rank builds wider (a config read from another file, a
rank-dependent branch), an optimizer with another learning rate, a loader of
another length, a ``DistState`` with another precision (``FACCEL_PRECISION``
set on one node only): each used to surface later, and differently per rank
(DDP's own shape check raises torch's ``RuntimeError`` on one rank and a gloo
error on the other; FSDP2 and tensor parallelism shard garbage or hang).

``prepare`` describes what it was given on this rank, before it wraps, shards
or parallelizes anything (:func:`describe`: names, shapes and dtypes, meta
tensors included; optimizer groups and their hyper-parameters; loader lengths
and batch sizes; the ``DistState`` fields that must agree; the kinds and
number of objects of the call), and the ranks compare a SHA-256 of the
canonical JSON in one ``all_gather`` of 40 bytes each (:func:`check_setup`).
Only when the digests differ do the ranks exchange the descriptions (a
second ``all_gather`` of the longest one's bytes), so every rank finds the
same first difference (:func:`mismatch_problem`) and raises the same
:class:`~faccel.errors.SetupMismatchError`. Tensors, never pickle. In one
process nothing is described or sent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from faccel._data._loader import PreparedLoader
from faccel._data._rebuild import _plain_shuffle
from faccel._dist._collectives import all_gather_bytes
from faccel._dist._process_group import comm_device, peers_answer, require_group
from faccel._dist._state import DistState
from faccel._loop._options import PrepareOptions
from faccel.errors import SetupMismatchError

__all__ = ["Entry", "check_setup", "describe", "difference_problem", "encode", "mismatch_problem"]

# One described item: [where it is, what it is, its JSON value], e.g.
# ["the Sequential (argument 0)", "parameter 0.weight", {"shape": [16, 8], ...}].
Entry = list[Any]
# The first all_gather: the description's length (8 bytes) and its SHA-256 (32 bytes).
_HEAD = 8 + 32
_CALL = "this prepare call"
# How deep a hyper-parameter's value is described (a scheduler's state_dict nests two levels).
_DEPTH = 8
# What a scheduler's state_dict holds that moves as it steps, or is derived from what is compared
# elsewhere (last_epoch and base_lrs have entries of their own; the learning rates are the
# optimizer's). Everything else in it (StepLR's gamma, CosineAnnealingLR's T_max, OneCycleLR's
# phases, SequentialLR's milestones and its schedulers' own) is a hyper-parameter.
_COUNTERS = frozenset(
    {
        "last_epoch",
        "base_lrs",
        "_step_count",
        "_last_lr",
        "_is_initial",
        "_get_lr_called_within_step",
        "verbose",
        "best",
        "num_bad_epochs",
        "cooldown_counter",
    }
)


def _plain(value: Any, depth: int = 0) -> Any:
    """A hyper-parameter as JSON: numbers, strings and lists of them as they are; anything else by type.

    Dicts (a scheduler's ``state_dict``) are walked too, without its counters, down to a fixed depth.
    """
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if depth >= _DEPTH:
        return type(value).__qualname__
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items() if k not in _COUNTERS}
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.device.type != "meta":  # a tensor learning rate
            return value.detach().cpu().reshape(()).item()
        return {"tensor": list(value.shape), "dtype": str(value.dtype)}
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    return type(value).__qualname__


def _tensor(tensor: torch.Tensor) -> dict[str, Any]:
    # .shape of a DTensor (a model prepared before) is the global shape: the same on every rank.
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype)}


def _module(module: nn.Module) -> Iterator[tuple[str, Any]]:
    yield "class", type(module).__qualname__
    # A meta build takes another path through prepare (sharded, then materialized) than a real one.
    yield "built on meta", any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    for name, param in module.named_parameters():
        yield f"parameter {name}", {**_tensor(param), "requires_grad": param.requires_grad}
    for name, buffer in module.named_buffers():
        yield f"buffer {name}", _tensor(buffer)


def _optimizer(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, Any]]:
    yield "class", type(optimizer).__qualname__
    yield "parameter groups", len(optimizer.param_groups)
    for index, group in enumerate(optimizer.param_groups):
        params = group["params"]
        hyper = {key: _plain(value) for key, value in sorted(group.items()) if key != "params"}
        yield f"group {index}", {"parameters": len(params), **hyper}
        for number, param in enumerate(params):
            yield f"group {index} parameter {number}", _tensor(param)


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:  # an IterableDataset without __len__
        return None


def _sampler(sampler: object) -> dict[str, Any] | None:
    """What decides a sampler's order: its class, whether faccel shuffles for it, its plain settings.

    ``shuffle`` is True for a ``RandomSampler`` that draws every sample once and False for a
    ``SequentialSampler`` (faccel draws those orders itself, from ``dist.seed``), None for any
    other sampler (its own order is dealt; faccel also compares the orders drawn at prepare).
    The plain public attributes (a custom sampler's ``seed``, ``replacement``, a batch sampler's
    ``batch_size`` and ``drop_last``) go with them; its data and generator do not (faccel reseeds it).
    """
    if sampler is None:
        return None
    out: dict[str, Any] = {"class": type(sampler).__qualname__, "shuffle": _plain_shuffle(sampler)}
    for key, value in sorted(getattr(sampler, "__dict__", {}).items()):
        if not key.startswith("_") and (value is None or isinstance(value, bool | int | float | str)):
            out[key] = value
    count = getattr(type(sampler), "num_samples", None)
    if isinstance(count, property):  # RandomSampler's num_samples= (private under the property)
        out["num_samples"] = _plain(getattr(sampler, "num_samples", None))
    inner = getattr(sampler, "sampler", None)  # a batch sampler's sampler
    if inner is not None and inner is not sampler:
        out["sampler"] = _sampler(inner)
    return out


def _loader(loader: DataLoader) -> Iterator[tuple[str, Any]]:  # type: ignore[type-arg]
    yield "class", type(loader).__qualname__
    yield "length", _length(loader)
    yield "batch_size", loader.batch_size
    yield "drop_last", loader.drop_last
    yield "dataset length", _length(loader.dataset)
    # The order: shuffle=True on one rank and False on another deals overlapping shares.
    yield "sampler", _sampler(loader.sampler)
    yield "batch_sampler", _sampler(loader.batch_sampler)


def _prepared_loader(loader: PreparedLoader) -> Iterator[tuple[str, Any]]:
    s = loader.sharding  # its rank differs by design; its plan must not
    yield "batch_size", loader.batch_size
    for field in ("num_samples", "world_size", "shuffle", "drop_last", "even_batches", "seed"):
        yield f"sharding {field}", _plain(getattr(s, field, None))
    yield "sharding sampler", _sampler(getattr(s, "sampler", None))


def _scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler) -> Iterator[tuple[str, Any]]:
    yield "class", type(scheduler).__qualname__
    yield "last_epoch", scheduler.last_epoch
    yield "base_lrs", _plain(scheduler.base_lrs)
    # The hyper-parameters (StepLR's gamma, a cosine's T_max ...): its state_dict less the counters.
    # A LambdaLR's functions are code: the state_dict holds None for them, so they are not compared.
    yield "hyper-parameters", _plain(scheduler.state_dict())


def _value(obj: Any) -> Iterator[tuple[str, Any]]:
    return iter(())  # a tag or a config comes back unchanged: its kind is compared, not its value


# Each kind of object prepare takes, and what of it must agree across ranks (first match wins).
_KINDS: tuple[tuple[str, type, Callable[[Any], Iterator[tuple[str, Any]]]], ...] = (
    ("model", nn.Module, _module),
    ("optimizer", torch.optim.Optimizer, _optimizer),
    ("scheduler", torch.optim.lr_scheduler.LRScheduler, _scheduler),
    ("loader", DataLoader, _loader),
    ("prepared loader", PreparedLoader, _prepared_loader),
)


def _kind(obj: Any) -> tuple[str, Callable[[Any], Iterator[tuple[str, Any]]]]:
    for name, kind, describe_one in _KINDS:
        if isinstance(obj, kind):
            return name, describe_one
    return "other value", _value


def _dist(dist: DistState) -> Iterator[tuple[str, Any]]:
    yield "dist.world_size", dist.world_size
    yield "dist.backend", dist.backend
    yield "dist.device type", dist.device.type
    yield "dist.strategy", dist.strategy
    yield "dist.layout", repr(dist.parallel)
    yield "dist.precision", dist.precision
    yield "dist.accumulation_steps", dist.accumulation_steps
    yield "dist.seed", dist.seed
    yield "dist.attempt", dist.attempt
    digest = None if dist.deepspeed is None else hashlib.sha256(dist.deepspeed.encode()).hexdigest()[:16]
    yield "dist.deepspeed config (digest)", digest


def _options(options: PrepareOptions) -> Iterator[tuple[str, Any]]:
    init = options.init
    yield "init", init if isinstance(init, str) else f"a callable ({_callable_name(init)})"
    yield "even_batches", options.even_batches
    yield "split_batches", options.split_batches
    yield "worker_seeds", options.worker_seeds
    plan = options.tp_plan
    yield "tp_plan", None if plan is None else {str(k): type(v).__qualname__ for k, v in plan.items()}
    # What the policy selects is compared with the model it is applied to (_chosen).
    yield "shard_policy", None if options.shard_policy is None else "a callable"
    ddp = options.ddp_kwargs
    yield "ddp_kwargs", None if ddp is None else {str(k): _plain(v) for k, v in ddp.items()}
    yield "activation_checkpointing", _selector(options.activation_checkpointing)
    yield "offload", options.offload
    yield "reshard_after_forward", options.reshard_after_forward
    yield "comm_hook", options.comm_hook
    # Another PowerSGD rank or start per rank: DDP's reducer would exchange matrices of other sizes.
    hook = options.comm_hook_options
    yield "comm_hook_options", None if hook is None else {str(k): _plain(v) for k, v in hook.items()}


def _callable_name(fn: Any) -> str:
    """Where a function is defined, the same on every rank (its identity is not)."""
    kind = fn if isinstance(fn, type) else type(fn)
    module = getattr(fn, "__module__", None) or kind.__module__
    return f"{module}.{getattr(fn, '__qualname__', kind.__qualname__)}"


def _chosen(model: nn.Module, predicate: Callable[[nn.Module], bool]) -> Any:
    """The submodule names ``predicate`` picks in ``model`` (the root left out, as ``prepare`` does).

    A predicate that raises is described by its error rather than raised: the description must
    reach the collective on every rank, or the ranks that did not raise would wait there.
    """
    try:
        return [name for name, module in model.named_modules() if module is not model and predicate(module)]
    except Exception as error:  # the predicate is user code; prepare raises it later, on every rank alike
        return f"raised {type(error).__qualname__}"


def _selections(model: nn.Module, options: PrepareOptions) -> Iterator[tuple[str, Any]]:
    """What the options that pick submodules pick in this model: another policy per rank shards apart."""
    if options.shard_policy is not None:
        yield "shard_policy selects", _chosen(model, options.shard_policy)
    selector = options.activation_checkpointing
    if selector is not None and not isinstance(selector, type | tuple):
        yield "activation_checkpointing selects", _chosen(model, selector)


def _selector(selector: Any) -> Any:
    """Classes by name (the same on every rank); a predicate only as one (its identity differs)."""
    if selector is None:
        return None
    if isinstance(selector, type):
        return selector.__qualname__
    if isinstance(selector, tuple):
        return [_selector(each) for each in selector]
    return "a callable"


def describe(dist: DistState, objs: Sequence[Any], options: PrepareOptions) -> list[Entry]:
    """What of one ``prepare`` call must be the same on every rank, as JSON entries in a fixed order.

    The ``DistState`` fields first, then the options, then the kinds of the
    objects (so another number or order of objects is named before their
    contents), then each object's contents: a model's parameters and buffers
    (name, shape, dtype; meta tensors too), an optimizer's groups (size,
    hyper-parameters, each parameter's shape), a loader's length and batch size.
    Nothing that differs by design (the rank, the device index, a tag's value).

    Example:
        >>> import torch, faccel
        >>> entries = describe(faccel.detect({}), [torch.nn.Linear(2, 1)], PrepareOptions())
        >>> entries[-2][:2], entries[-2][2]["shape"]
        (['the Linear (argument 0)', 'parameter weight'], [1, 2])
    """
    entries: list[Entry] = [["the DistState", item, value] for item, value in _dist(dist)]
    entries += [["prepare's options", item, value] for item, value in _options(options)]
    kinds = [_kind(obj) for obj in objs]
    entries.append([_CALL, "objects", [name for name, _ in kinds]])
    for index, (obj, (name, describe_one)) in enumerate(zip(objs, kinds, strict=True)):
        where = f"the {type(obj).__qualname__} (argument {index})" if name != "other value" else ""
        entries += [[where, item, value] for item, value in describe_one(obj)]
        if name == "model":
            entries += [[where, item, value] for item, value in _selections(obj, options)]
    return entries


def encode(entries: Sequence[Entry]) -> bytes:
    """The canonical JSON of a description: the same bytes for the same description on every rank.

    Example:
        >>> encode([["the DistState", "dist.seed", 0]])
        b'[["the DistState","dist.seed",0]]'
    """
    return json.dumps(list(entries), sort_keys=True, separators=(",", ":")).encode()


def _show(value: Any) -> str:
    # As encode() writes it, with the spaces a message reads well with.
    return json.dumps(value, sort_keys=True)


def _where(entry: Entry) -> str:
    if entry[0] == _CALL:
        return f" (in {_CALL})"
    return f" ({entry[0]} of {_CALL})" if entry[0] else ""


def difference_problem(
    mine: Sequence[Entry], reference: Sequence[Entry], *, rank: int, of: int = 0
) -> str | None:
    """The first entry where rank ``rank``'s description ``mine`` differs from rank ``of``'s, or None.

    Example:
        >>> a = [["the Linear", "parameter weight", {"shape": [1, 2]}]]
        >>> b = [["the Linear", "parameter weight", {"shape": [1, 3]}]]
        >>> difference_problem(b, a, rank=1)
        'rank 1: parameter weight has shape [1, 3], rank 0 has [1, 2] (the Linear of this prepare call)'
        >>> difference_problem(a, a, rank=1) is None
        True
    """
    for index in range(max(len(mine), len(reference))):
        if index >= len(mine):
            extra = reference[index]
            return f"rank {rank}: has nothing where rank {of} has {extra[1]}{_where(extra)}"
        if index >= len(reference):
            return f"rank {rank}: has {mine[index][1]}{_where(mine[index])} where rank {of} has nothing"
        got, want = list(mine[index]), list(reference[index])
        # Compared as the canonical JSON the digests hash (1 and 1.0, or True and 1, differ there too),
        # so a difference of digests always has a difference to name.
        if _show(got) == _show(want):
            continue
        if _show(got[:2]) != _show(want[:2]):
            # Another item at this place: an extra or missing parameter, another kind of object...
            return f"rank {rank}: has {got[1]}{_where(got)} where rank {of} has {want[1]}{_where(want)}"
        value, expected = got[2], want[2]
        if isinstance(value, dict) and isinstance(expected, dict):
            for key in sorted(set(value) | set(expected), key=lambda k: (k not in expected, str(k))):
                if key not in value or key not in expected or _show(value[key]) != _show(expected[key]):
                    have = _show(value[key]) if key in value else "none"
                    other = _show(expected[key]) if key in expected else "none"
                    return f"rank {rank}: {got[1]} has {key} {have}, rank {of} has {other}{_where(got)}"
        return f"rank {rank}: {got[1]} is {_show(value)}, rank {of} has {_show(expected)}{_where(got)}"
    return None


def mismatch_problem(descriptions: Sequence[Sequence[Entry]]) -> str | None:
    """The first difference of any rank's description from rank 0's (the lowest rank first), or None.

    Example:
        >>> same = [["the DistState", "dist.precision", "no"]]
        >>> mismatch_problem([same, same, [["the DistState", "dist.precision", "bf16"]]])
        'rank 2: dist.precision is "bf16", rank 0 has "no" (the DistState of this prepare call)'
    """
    for rank, description in enumerate(descriptions[1:], start=1):
        problem = difference_problem(description, descriptions[0], rank=rank)
        if problem is not None:
            return problem
    return None


def _all_gather(dist: DistState, payload: bytes, size: int) -> list[bytes]:
    """Every rank's ``payload`` (each at most ``size`` bytes), through the collectives' byte exchange."""
    raw = all_gather_bytes(payload, size + 4, comm_device(dist), dist.world_size)
    return [r[4 : 4 + int.from_bytes(r[:4], "little")] for r in raw]


def check_setup(dist: DistState, objs: Sequence[Any], options: PrepareOptions) -> None:
    """Raise the same error on every rank unless every rank passed the same set-up to this ``prepare``.

    One ``all_gather`` of 40 bytes a rank (the description's length and
    SHA-256); the descriptions themselves only when the digests differ. Not
    distributed (one process, or a simulated state): nothing to compare.

    Raises:
        SetupMismatchError: A rank's description differs from rank 0's; the
            message names the rank and the first item that differs.

    Example:
        >>> import torch, faccel
        >>> check_setup(faccel.detect({}), [torch.nn.Linear(2, 1)], PrepareOptions())  # alone: nothing to do
    """
    if not dist.distributed:
        return
    require_group(dist, "prepare")
    payload = encode(describe(dist, objs, options))
    head = len(payload).to_bytes(8, "little") + hashlib.sha256(payload).digest()
    with peers_answer(dist, "prepare"):
        heads = _all_gather(dist, head, _HEAD)
        if all(h == heads[0] for h in heads):
            return
        lengths = [int.from_bytes(h[:8], "little") for h in heads]
        raw = _all_gather(dist, payload, max(lengths))
    descriptions = [json.loads(r[:n]) for r, n in zip(raw, lengths, strict=True)]
    # Other digests always come with another JSON text, which mismatch_problem names; the fallback is a guard.
    problem = mismatch_problem(descriptions) or "the ranks' descriptions differ"
    msg = (
        f"prepare() on rank {dist.rank}: the ranks were not given the same set-up: {problem}. Every rank "
        "must build the same model, optimizer and loaders (from the same config, with no rank-dependent "
        "sizes), run under the same settings (FACCEL_* variables, detect() arguments), and make the same "
        "prepare() calls with the same objects in the same order"
    )
    raise SetupMismatchError(msg)
