"""Every private PyTorch API faccel uses, behind one small function each.

PyTorch may change anything with a leading underscore in any release. faccel
reaches into it in a few places where no public API does the job; each such
use lives here, under a name that says what it is for, and
``tests/test_torch_compat.py`` calls each one by name on real objects, so a
torch upgrade that breaks one fails that test with the use in its name instead
of failing somewhere deep in a training run. pyproject.toml claims only the
torch releases the suite has run on.

No other module of faccel touches a private torch name (``tests/test_torch_compat.py``
scans for them). Public-API facts that are asked in many places (whether a
tensor is a DTensor) live here too, so that there is one answer.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.utils._pytree as pytree  # torch.func's own tree registry; no public equivalent
from torch import nn

__all__ = [
    "batched_powersgd_works",
    "compiled_original",
    "default_store",
    "dtensor_local",
    "fake_tensors",
    "flatten_mesh",
    "incompatible_keys",
    "is_dtensor",
    "like_dtensor",
    "local_box",
    "local_rows",
    "module_dicts",
    "non_persistent_buffers",
    "pipelining_metadata_error",
    "pytree",
    "random_sampler_draws_all",
    "rebuild_ddp_buckets",
    "set_group_timeout",
    "view_base",
]


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (FSDP2 and TP parameters).

    Imports nothing: while ``torch.distributed.tensor`` has not been imported,
    no DTensor can exist, so the answer is False without paying its import.

    Example:
        >>> import torch
        >>> is_dtensor(torch.zeros(2))
        False
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def default_store() -> Any:
    """The default process group's key-value store (``TCPStore`` or ``FileStore``).

    torch exposes the store only through this private accessor of
    ``distributed_c10d``; faccel uses it to meet peers outside the backend
    (arrival checks, background checkpoints), so a missing peer is named instead
    of hanging a collective.
    """
    import torch.distributed as tdist

    return tdist.distributed_c10d._get_default_store()


def rebuild_ddp_buckets(ddp: Any) -> None:
    """Make ``ddp`` (a ``DistributedDataParallel``) rebuild its gradient buckets now, in parameter order.

    DDP's reducer rebuilds its buckets after the first step; calling its two
    private methods at construction gives every job, fresh or resumed, the same
    bucket layout from step one (see ``_loop/_model.py``). Both are collectives.
    """
    ddp.reducer._push_all_rebuilt_params()
    ddp.reducer._rebuild_buckets()


def ddp_ignore(module: nn.Module, names: list[str]) -> None:
    """Make a ``DistributedDataParallel`` built next around ``module`` leave the parameters ``names`` alone.

    DDP neither broadcasts them at construction nor averages their gradients
    (``_set_params_and_buffers_to_ignore_for_model``): expert parallelism's
    experts, which differ by rank.
    """
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def dtensor_local(tensor: Any) -> tuple[torch.Tensor, Any]:
    """``(local tensor, spec)`` of the DTensor ``tensor``: this rank's part, and what places it.

    What ``to_local`` reads, without its autograd node: for a custom autograd
    function that returns the local part and gives back a gradient of the
    same placement (:func:`like_dtensor`) in one node.
    """
    return tensor._local_tensor, tensor._spec


def like_dtensor(local: torch.Tensor, spec: Any) -> Any:
    """A DTensor placed by ``spec`` (from :func:`dtensor_local`) around ``local``, outside autograd.

    ``local`` has the shape and strides of the local part ``spec`` came with:
    what ``to_local``'s backward builds (the gradient of a DTensor parameter),
    without the autograd function and placement arithmetic of ``from_local``.
    """
    import copy

    from torch.distributed.tensor import DTensor

    # a copy, as to_local's backward makes: sharding propagation may change a spec it holds
    return DTensor(local, copy.copy(spec), requires_grad=False)


def local_box(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offset, shape)`` of this rank's part of the DTensor ``tensor`` in the whole tensor.

    Through torch's own placement arithmetic (``compute_local_shape_and_global_offset``),
    for any placement FSDP2, HSDP and tensor parallelism use, uneven shards included.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offset), tuple(shape)


def local_rows(tensor: Any) -> tuple[int, int]:
    """``(start, stop)``: the rows of the whole tensor that this rank's part of DTensor ``tensor`` holds."""
    offset, shape = local_box(tensor)
    return offset[0], offset[0] + shape[0]


def random_sampler_draws_all(sampler: torch.utils.data.RandomSampler) -> bool:
    """Whether a ``RandomSampler`` draws each index once: no replacement and no ``num_samples`` set.

    The public ``num_samples`` property answers the dataset's length when none
    was given, so only the private field tells "not given" from "given as the
    length".
    """
    return not sampler.replacement and sampler._num_samples is None


def module_dicts(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``module``'s own ``(_modules, _parameters, _buffers)`` dicts, the ones ``nn.Module`` reads.

    A fast functional call swaps tensors in these dicts directly
    (``_func/_module_call.py``); ``torch.func.functional_call`` does the same
    through ``torch.nn.utils.stateless``.
    """
    return module._modules, module._parameters, module._buffers  # type: ignore[return-value]


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers registered with ``persistent=False`` (no state dict holds them)."""
    return module._non_persistent_buffers_set


def compiled_original(model: object) -> nn.Module | None:
    """The module ``torch.compile`` wrapped, for an ``OptimizedModule``; None for anything else."""
    # Read from the submodules' dict: a getattr that misses costs nn.Module.__getattr__'s error, and
    # this runs for every layer unwrapped (clipping, every step).
    modules = getattr(model, "_modules", None)
    original = modules.get("_orig_mod") if isinstance(modules, dict) else None
    return original if isinstance(original, nn.Module) else None


def incompatible_keys(missing: list[str], unexpected: list[str]) -> Any:
    """What ``Module.load_state_dict`` returns (``_IncompatibleKeys``), for a module loading its own way."""
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def pipelining_metadata_error() -> type[Exception]:
    """The error torch's pipeline stages raise for an output they cannot pass on (a dict, a model output)."""
    from torch.distributed.pipelining._utils import PipeliningMetadataError

    return PipeliningMetadataError


def set_group_timeout(group: Any, timeout: Any) -> None:
    """Change a live process group's collective ``timeout`` (a ``timedelta``).

    The public API fixes a group's timeout when the group is made; torch's
    private setter (what torchtitan calls) changes it later, for the shorter
    timeout once training has warmed up (``FACCEL_TRAIN_TIMEOUT``).
    """
    import torch.distributed as tdist

    tdist.distributed_c10d._set_pg_timeout(timeout, group)


def view_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``tensor`` views (``tensor`` itself when it is no view).

    A memory plan counts each storage a forward saves once, and tells a
    parameter's transpose (what ``nn.Linear`` saves) from an activation; on the
    meta device there are no data pointers to compare, so the view's base is
    the one answer.
    """
    base = tensor._base
    return tensor if base is None else base


def fake_tensors() -> Any:
    """A context in which tensors have shapes, dtypes and a device but no storage (``FakeTensorMode``).

    A model built in it is a CPU model that allocates nothing, and its forward
    runs each op's real dispatch for the CPU (the attention kernel the CPU
    would pick), so the tensors it saves for backward are those a real forward
    saves, byte for byte. Tensors made outside it may be passed in.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh`` (a DeviceMesh slice) flattened into one dimension named ``name`` (``DeviceMesh._flatten``).

    The flattened dimension is registered on the root mesh, so ``root[name]``
    and ``root["replicate", name]`` slice it afterwards (torchtitan's
    ``dp_shard_cp``). A collective the first time: every rank must call it.
    """
    return mesh._flatten(name)


def batched_powersgd_works() -> bool:
    """Whether torch's ``batched_powerSGD_hook`` can run: it orthogonalizes 2-D matrices, and some
    versions' ``_orthogonalize`` takes only a 3-D batch (a bare ``AssertionError`` at the first
    compressed step). Asked of the private function itself, so a torch that mends it is let through."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
    except AssertionError:
        return False
    return True
