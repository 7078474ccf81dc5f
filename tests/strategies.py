"""Hypothesis strategies shared by the test modules."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import attrs
import torch
from hypothesis import strategies as st

world_sizes = st.integers(min_value=1, max_value=1024)
small_world_sizes = st.integers(min_value=1, max_value=16)
ints_as_text = st.integers(min_value=0, max_value=4096).map(str)


@st.composite
def shardings(draw: st.DrawFn, *, max_samples: int = 100_000, max_world: int = 1024) -> dict:
    """Keyword arguments of a faccel.Sharding (without rank)."""
    return {
        "num_samples": draw(st.integers(min_value=0, max_value=max_samples)),
        "batch_size": draw(st.integers(min_value=1, max_value=512)),
        "world_size": draw(st.integers(min_value=1, max_value=max_world)),
        "shuffle": draw(st.booleans()),
        "drop_last": draw(st.booleans()),
        "even_batches": draw(st.booleans()),
        "seed": draw(st.integers(min_value=0, max_value=2**31)),
    }


@st.composite
def sampler_forms(draw: st.DrawFn, *, max_samples: int = 600, max_world: int = 256) -> dict:
    """Keyword arguments of a faccel.Sharding (without rank) for each loader form.

    The plain shuffled/sequential form; a custom sampler's output (a list of
    indices, repeats allowed, as WeightedRandomSampler draws); or a batch
    sampler's batches (lists of varying sizes), dealt whole.
    """
    form = draw(st.sampled_from(["plain", "sampler", "batches"]))
    world = draw(st.integers(min_value=1, max_value=max_world))
    common = {"world_size": world, "even_batches": draw(st.booleans()), "seed": draw(st.integers(0, 2**31))}
    n = draw(st.integers(min_value=0, max_value=max_samples))
    if form == "plain":
        b = draw(st.integers(min_value=1, max_value=64))
        return {
            "num_samples": n,
            "batch_size": b,
            "shuffle": draw(st.booleans()),
            "drop_last": draw(st.booleans()),
            **common,
        }
    if form == "sampler":
        order = draw(st.lists(st.integers(0, max(n - 1, 0)), min_size=n, max_size=n))
        b = draw(st.integers(min_value=1, max_value=64))
        return {
            "num_samples": n,
            "batch_size": b,
            "drop_last": draw(st.booleans()),
            "sampler": order,
            **common,
        }
    sizes = draw(st.lists(st.integers(1, 9), max_size=max(1, n // 4)))
    flat = iter(range(sum(sizes)))
    batches = [[next(flat) for _ in range(size)] for size in sizes]
    return {"num_samples": len(batches), "batch_size": 1, "sampler": batches, "whole_batches": True, **common}


@st.composite
def torchrun_envs(draw: st.DrawFn) -> dict[str, str]:
    """A valid torchrun environment, nodes of equal size."""
    nodes = draw(st.integers(min_value=1, max_value=8))
    per_node = draw(st.integers(min_value=1, max_value=8))
    node = draw(st.integers(min_value=0, max_value=nodes - 1))
    local = draw(st.integers(min_value=0, max_value=per_node - 1))
    env = {
        "RANK": str(node * per_node + local),
        "WORLD_SIZE": str(nodes * per_node),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(node),
        "MASTER_ADDR": draw(st.sampled_from(["127.0.0.1", "node0", "10.1.2.3"])),
        "MASTER_PORT": str(draw(st.integers(min_value=1, max_value=65535))),
    }
    return env


@st.composite
def slurm_envs(draw: st.DrawFn) -> dict[str, str]:
    nodes = draw(st.integers(min_value=1, max_value=8))
    per_node = draw(st.integers(min_value=1, max_value=8))
    node = draw(st.integers(min_value=0, max_value=nodes - 1))
    local = draw(st.integers(min_value=0, max_value=per_node - 1))
    return {
        "SLURM_PROCID": str(node * per_node + local),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_LOCALID": str(local),
        "SLURM_NTASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
        "SLURM_NODEID": str(node),
        "SLURM_NODELIST": "gpu[07-09]",
        "SLURM_JOB_ID": str(draw(st.integers(min_value=1, max_value=10**7))),
    }


@st.composite
def mpi_envs(draw: st.DrawFn) -> dict[str, str]:
    nodes = draw(st.integers(min_value=1, max_value=8))
    per_node = draw(st.integers(min_value=1, max_value=8))
    node = draw(st.integers(min_value=0, max_value=nodes - 1))
    local = draw(st.integers(min_value=0, max_value=per_node - 1))
    return {
        "OMPI_COMM_WORLD_RANK": str(node * per_node + local),
        "OMPI_COMM_WORLD_SIZE": str(nodes * per_node),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(per_node),
        "MASTER_ADDR": "head",
        "MASTER_PORT": "29400",
    }


# Text that int() refuses (after strip), for malformed-variable tests.
not_integers = st.one_of(
    # The last one: a non-ASCII digit, which int() accepts alone, made invalid by the x.
    st.sampled_from(["", "one", "1.5", "0x2", "2 2", "nan", "-", "١x"]),  # noqa: RUF001
    st.text(alphabet="abcxyz.-", min_size=1, max_size=5),
)


# --- functional training (tests/test_functional.py) ---

# Tensor shapes, 0-d and empty ones included.
tensor_shapes = st.lists(st.integers(min_value=0, max_value=4), max_size=3).map(tuple)

# A params dict's layout: module-like names to shapes.
param_layouts = st.dictionaries(
    keys=st.from_regex(r"[a-z]{1,3}(\.[a-z0-9]{1,3})?", fullmatch=True),
    values=tensor_shapes,
    min_size=1,
    max_size=4,
)


@st.composite
def sgd_hyperparams(draw: st.DrawFn) -> dict:
    """Keyword arguments valid for both torch.optim.SGD and faccel.func.sgd."""
    momentum = draw(st.sampled_from([0.0, 0.5, 0.9]) | st.floats(min_value=0.0, max_value=0.99))
    dampening = draw(st.sampled_from([0.0, 0.0, 0.1]))
    return {
        "lr": draw(st.floats(min_value=0.0, max_value=1.0)),
        "momentum": momentum,
        "dampening": dampening,
        "weight_decay": draw(st.sampled_from([0.0, 1e-4]) | st.floats(min_value=0.0, max_value=0.5)),
        "nesterov": momentum > 0 and dampening == 0 and draw(st.booleans()),
        "maximize": draw(st.booleans()),
    }


@st.composite
def adamw_hyperparams(draw: st.DrawFn) -> dict:
    """Keyword arguments valid for both torch.optim.AdamW and faccel.func.adamw."""
    beta = st.sampled_from([0.0, 0.9, 0.999]) | st.floats(min_value=0.0, max_value=0.9999)
    return {
        "lr": draw(st.floats(min_value=1e-6, max_value=1.0)),
        "betas": (draw(beta), draw(beta)),
        "eps": draw(st.sampled_from([1e-8, 1e-6, 1e-3]) | st.floats(min_value=1e-12, max_value=1e-1)),
        "weight_decay": draw(st.sampled_from([0.0, 1e-2]) | st.floats(min_value=0.0, max_value=1.0)),
        "amsgrad": draw(st.booleans()),
        "maximize": draw(st.booleans()),
    }


@st.composite
def module_specs(draw: st.DrawFn) -> dict:
    """A small module to call functionally: an MLP, maybe normalised, tied, or given a subset of names.

    ``widths``: feature sizes, input first; ``norm``: a BatchNorm1d (buffers) after the
    first layer; ``tie``: ``"none"``, ``"alias"`` (one Linear reachable under two names)
    or ``"weight"`` (two Linears sharing one weight); ``drop``: how many parameter
    names to leave out of the dict passed in (0: all of them).
    """
    width = draw(st.integers(min_value=1, max_value=5))
    hidden = draw(st.lists(st.integers(min_value=1, max_value=5), min_size=0, max_size=2))
    return {
        "widths": [width, *hidden, width],
        "norm": draw(st.booleans()),
        "tie": draw(st.sampled_from(["none", "alias", "weight"])),
        "drop": draw(st.sampled_from([0, 0, 0, 1])),
        "seed": draw(st.integers(min_value=0, max_value=2**16)),
    }


# --- checkpoints (tests/test_checkpoint*.py, tests/test_serialize.py) ---


@st.composite
def checkpoint_specs(draw: st.DrawFn) -> dict:
    """A spec for tests/distributed/checkpoint_workers.build: model, optimizer, scheduler, data."""
    batch_size = draw(st.integers(min_value=2, max_value=5))
    # At least one full batch per rank for two ranks (batch norm drops the short last batch).
    samples = draw(st.integers(min_value=2 * batch_size, max_value=20))
    return {
        "width": draw(st.integers(min_value=2, max_value=6)),
        "depth": draw(st.integers(min_value=1, max_value=3)),
        "tied": draw(st.booleans()),
        "dropout": draw(st.booleans()),
        "batchnorm": draw(st.booleans()),
        "transposed": draw(st.booleans()),
        "optimizer": draw(st.sampled_from(["sgd", "adam", "adamw_amsgrad"])),
        "groups": draw(st.sampled_from([1, 2])),
        "scheduler": draw(st.sampled_from([None, "step", "cosine", "onecycle", "lambda", "plateau"])),
        "scaler": draw(st.booleans()),
        "samples": samples,
        "batch_size": batch_size,
        "total_steps": draw(st.integers(min_value=1, max_value=10)),
    }


_json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)

# Values a checkpoint's extras may hold without tensors: JSON, tuples, non-string keys, bytes.
plain_trees = st.recursive(
    _json_leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=6) | st.integers(min_value=-5, max_value=5), inner, max_size=3)
    ),
    max_leaves=12,
)


# --- nested containers (faccel._tree) ------------------------------------------------------------

Pair = namedtuple("Pair", ["a", "b"])


@attrs.frozen(kw_only=True)
class Record:
    """An attrs record among the containers a batch or a model output may be."""

    first: Any
    second: Any = None


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.text("abc", min_size=1, max_size=2)
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.tuples(children, children).map(lambda ab: Pair(*ab)),
        st.dictionaries(keys, children, max_size=3),
        st.dictionaries(keys, children, max_size=3).map(OrderedDict),
        st.dictionaries(keys, children, max_size=3).map(lambda d: defaultdict(list, d)),
        st.tuples(children, children).map(lambda ab: Record(first=ab[0], second=ab[1])),
    )


tree_tensors = st.integers(0, 3).map(lambda n: torch.arange(float(n)))
# Nests of every container kind faccel walks, with tensor leaves only (what collectives take).
tensor_trees = st.recursive(tree_tensors, _containers, max_leaves=8)
# The same with other leaves among the tensors (batches carry ids and strings).
mixed_trees = st.recursive(
    tree_tensors | st.integers(-3, 3) | st.text("xy", max_size=2) | st.none(), _containers, max_leaves=8
)


# --- hostile launcher environments (faccel._dist._launch) ----------------------------------------------

# What ends up in a variable by accident or malice: digits of other scripts, Python's int()
# extras, huge values, empty strings, and plausible small numbers so that valid jobs occur too.
_env_values = st.one_of(
    st.integers(0, 9).map(str),
    st.integers(0, 2**70).map(str),
    st.sampled_from(
        ["", " 1", "1 ", "+1", "-1", "0_1", "1_0", "\uff11", "\u0662", "2**70", "0x10", "1e3", "[", "node[1-"]
    ),
    st.text(max_size=6),
)


@st.composite
def launcher_envs(draw: st.DrawFn) -> dict[str, str]:
    """Any subset of the variables faccel reads, each with any of the values above."""
    from faccel._dist._launch import ENV_VARIABLES

    names = sorted({name for group in ENV_VARIABLES.values() for name in group})
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=8))
    return {name: draw(_env_values, label=name) for name in chosen}


# --- restore: saved objects and the target objects a checkpoint is restored into ---

RESTORE_FIELDS = ("width", "optimizer", "split", "scheduler", "scaler", "extras")
_EXTRA_KINDS = ("tensor3", "tensor4", "count", "adam1", "adam3", "sgd")


def _restore_field(field: str) -> st.SearchStrategy[Any]:
    return {
        "width": st.sampled_from([4, 5]),
        "optimizer": st.sampled_from(["sgd", "adam", "adamw"]),
        "split": st.integers(min_value=0, max_value=3),  # 0: one param group, else two split there
        "scheduler": st.sampled_from([None, "step", "sequential2", "sequential3", "plateau"]),
        "scaler": st.booleans(),
        "extras": st.dictionaries(st.sampled_from("abc"), st.sampled_from(_EXTRA_KINDS), max_size=3),
    }[field]


@st.composite
def restore_specs(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(saved, target)`` specs of a TrainState's objects: the target differs in 0 to 2 fields.

    A spec names a model width, an optimizer kind and its param-group split, a
    scheduler kind (SequentialLR of 2 or 3), a grad scaler or none, and extras
    (tensors of two shapes, a count, optimizers over differently split groups);
    the saved one may hold a crafted optimizer state (``step_abc``).
    """
    saved = {field: draw(_restore_field(field)) for field in RESTORE_FIELDS}
    saved["step_abc"] = draw(st.booleans()) and draw(st.booleans())
    changed = draw(st.lists(st.sampled_from(RESTORE_FIELDS), max_size=2, unique=True))
    target = {**saved, "step_abc": False, **{field: draw(_restore_field(field)) for field in changed}}
    return saved, target


@st.composite
def interrupted_epochs(draw: st.DrawFn, *, max_samples: int = 3000, max_world: int = 256) -> dict:
    """One epoch read in stages at different world sizes: the sharding flags and each stage.

    ``stages`` is a list of ``(world_size, batch_size, fraction)``: the stage's ranks read
    that fraction of their batches (the last stage reads the rest of the epoch).
    """
    return {
        "num_samples": draw(st.integers(min_value=0, max_value=max_samples)),
        "shuffle": draw(st.booleans()),
        "drop_last": draw(st.booleans()),
        "even_batches": draw(st.booleans()),
        "seed": draw(st.integers(min_value=0, max_value=2**31)),
        "stages": draw(
            st.lists(
                st.tuples(
                    st.integers(min_value=1, max_value=max_world),
                    st.integers(min_value=1, max_value=64),
                    st.floats(min_value=0, max_value=1),
                ),
                min_size=2,
                max_size=4,
            )
        ),
    }


@st.composite
def layout_sizes(draw: st.DrawFn, *, max_world: int = 96) -> tuple[int, int, int]:
    """``(replicate, shard, tensor)``: any factorisation of a world of up to ``max_world`` ranks."""
    world = draw(st.integers(min_value=1, max_value=max_world))
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    tensor = draw(st.sampled_from(divisors))
    rest = world // tensor
    shard = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
    return (rest // shard, shard, tensor)


@st.composite
def layout_grids(draw: st.DrawFn, *, max_world: int = 96) -> dict[str, int]:
    """Sizes by name, every dimension of faccel's Layout: any factorisation of up to ``max_world`` ranks."""
    from faccel._dist._layout import DIMENSIONS

    world = draw(st.integers(min_value=1, max_value=max_world))
    sizes, rest = {}, world
    for name in DIMENSIONS[:-1]:
        sizes[name] = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
        rest //= sizes[name]
    sizes[DIMENSIONS[-1]] = rest
    order = draw(st.permutations(list(DIMENSIONS)))  # no dimension favoured by drawing first
    return {name: sizes[DIMENSIONS[order.index(name)]] for name in DIMENSIONS}


# Writes of any sizes, empty ones included: what a writer is handed, one call each.
byte_chunks = st.lists(st.binary(min_size=0, max_size=300), max_size=12)


@st.composite
def token_groups(draw: st.DrawFn) -> tuple[int, list[list[int]]]:
    """An accumulation size and an epoch of batches, each a list of sequence lengths (0 allowed)."""
    k = draw(st.integers(min_value=1, max_value=4))
    lengths = st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=3)
    return k, draw(st.lists(lengths, min_size=1, max_size=7))


# --- activation checkpointing (tests/test_activation_checkpointing.py) ---


@st.composite
def checkpointed_stacks(draw: st.DrawFn) -> dict:
    """A stack of dropout MLP blocks and which of them recompute: ``depth`` blocks of ``width``,
    dropout ``p``, the block indices in ``chosen`` (at least one), ``seed`` for the weights and masks."""
    depth = draw(st.integers(min_value=1, max_value=4))
    return {
        "depth": depth,
        "width": draw(st.integers(min_value=1, max_value=6)),
        "p": draw(st.sampled_from([0.0, 0.1, 0.5])),
        "chosen": draw(st.sets(st.integers(min_value=0, max_value=depth - 1), min_size=1)),
        "seed": draw(st.integers(min_value=0, max_value=2**16)),
    }


# JSON values as a set-up description holds them (faccel._loop._consistency): numbers, text, shapes,
# and records of those (a parameter's shape and dtype, an optimizer group's hyper-parameters).
_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=False, width=32)
    | st.text(max_size=3)
)
_json_values = (
    _json_scalars
    | st.lists(st.integers(0, 4), max_size=3)
    | st.dictionaries(st.sampled_from(["shape", "dtype", "lr", "parameters"]), _json_scalars, max_size=3)
)
_setup_entries = st.tuples(
    st.sampled_from(["the DistState", "the Linear (argument 0)", "the SGD (argument 1)", ""]),
    st.sampled_from(["dist.seed", "parameter 0.weight", "parameter 0.bias", "group 0", "length"]),
    _json_values,
).map(list)


@st.composite
def setup_description_pairs(draw: st.DrawFn) -> tuple[list[list[Any]], list[list[Any]]]:
    """Two set-up descriptions, often alike: the second is the first with a few entries changed,
    inserted or removed (or, now and then, drawn on its own)."""
    first = draw(st.lists(_setup_entries, max_size=6))
    if draw(st.integers(0, 9)) == 0:
        return first, draw(st.lists(_setup_entries, max_size=6))
    second = [list(entry) for entry in first]
    for _ in range(draw(st.integers(0, 2))):
        action = draw(st.sampled_from(["value", "insert", "remove"]))
        index = draw(st.integers(0, len(second)))
        if action == "insert":
            second.insert(index, draw(_setup_entries))
        elif second and index < len(second):
            if action == "remove":
                del second[index]
            else:
                second[index][2] = draw(_json_values)
    return first, second


@st.composite
def plan_param_specs(draw: st.DrawFn) -> list[Any]:
    """Parameters as the memory plan sees them: shapes of up to 3 dims (rows may be fewer than ranks),
    element sizes of 1 to 8 bytes, a tensor-parallel dim or none, frozen ones, a few FSDP2 units."""
    from faccel._report._memory_arith import ParamSpec

    out = []
    for index in range(draw(st.integers(min_value=1, max_value=8))):
        shape = tuple(draw(st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=3)))
        out.append(
            ParamSpec(
                name=f"p{index}",
                shape=shape,
                itemsize=draw(st.sampled_from([1, 2, 4, 8])),
                tensor_dim=draw(st.one_of(st.none(), st.integers(min_value=0, max_value=len(shape) - 1))),
                trainable=draw(st.booleans()),
                unit=draw(st.sampled_from(["", "layers.0", "layers.1"])),
            )
        )
    return out


@st.composite
def atom_layouts(draw: st.DrawFn, *, max_log_atoms: int = 7) -> dict:
    """Exact mode's tree: an atom count A (a power of two), a data-parallel size dividing it, buffer sizes."""
    log_atoms = draw(st.integers(0, max_log_atoms))
    log_world = draw(st.integers(0, log_atoms))
    return {
        "atoms": 2**log_atoms,
        "world": 2**log_world,
        # One buffer per dtype, some shorter than the world (those are sent whole, not halved).
        "numels": draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


_json_leaves = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8)
# A tagged-JSON tree as state.json holds one (its tensors are references: {"__tensor__": [file, key]}).
_json_trees = st.recursive(
    _json_leaves
    | st.tuples(st.sampled_from(["optimizer.safetensors", "extras.safetensors"]), st.text(max_size=6)).map(
        lambda ref: {"__tensor__": list(ref)}
    ),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
_counters = st.integers(min_value=0, max_value=2**40)
_names = st.text(alphabet="abcdefgh._0123", min_size=1, max_size=10)


@st.composite
def state_files(draw: st.DrawFn) -> Any:
    """A ``StateFile`` (``faccel._checkpoint._state_file``): what any faccel may have written."""
    from faccel._checkpoint._state_file import Extra, Section, StateFile

    def section(named: bool) -> st.SearchStrategy[Any]:
        made = st.builds(
            Section,
            state_dict=_json_trees,
            class_name=st.text(min_size=1, max_size=20) if named else st.none(),
        )
        return st.none() | made

    keys = draw(st.lists(_names, max_size=5, unique=True))
    return StateFile(
        step=draw(_counters),
        epoch=draw(_counters),
        position=draw(_counters),
        world_size=draw(st.integers(min_value=1, max_value=2**20)),
        model_keys=tuple(keys),
        model_aliases=draw(st.dictionaries(_names, _names, max_size=3)),
        optimizer=draw(section(True)),
        scheduler=draw(section(True)),
        scaler=draw(section(False)),
        extras=draw(
            st.dictionaries(_names, st.builds(Extra, stateful=st.booleans(), value=_json_trees), max_size=3)
        ),
        consumed=draw(st.none() | _counters),
        resumed_at=draw(st.none() | st.tuples(_counters, _counters)),
        tensors=draw(
            st.none() | st.dictionaries(st.sampled_from(["model", "optimizer"]), st.just({}), max_size=2)
        ),
    )
