"""Each private PyTorch API faccel uses, called by name: a torch upgrade that breaks one fails here.

``faccel/_torch_compat.py`` is the one module that touches torch's private
names; this file calls each of its functions on real objects (two gloo ranks
for the process-group ones) and scans the rest of faccel for private torch
names, so the list stays whole.
"""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from faccel import _torch_compat as compat
from tests.distributed import compat_workers, harness

PACKAGE = Path(__file__).resolve().parents[1] / "faccel"


def test_pytree_is_torch_funcs_registry() -> None:
    leaves, spec = compat.pytree.tree_flatten({"a": torch.zeros(1), "b": (torch.ones(1),)})
    assert len(leaves) == 2
    assert compat.pytree.tree_unflatten(leaves, spec)["b"][0].item() == 1.0
    assert compat.pytree.keystr((compat.pytree.MappingKey("a"),)) == "['a']"


def test_random_sampler_draws_all() -> None:
    data = list(range(5))
    assert compat.random_sampler_draws_all(torch.utils.data.RandomSampler(data))
    assert not compat.random_sampler_draws_all(torch.utils.data.RandomSampler(data, num_samples=5))
    assert not compat.random_sampler_draws_all(torch.utils.data.RandomSampler(data, replacement=True))


def test_module_dicts_are_the_ones_the_module_reads() -> None:
    module = nn.Linear(2, 1)
    module.register_buffer("scale", torch.ones(1))
    modules, params, buffers = compat.module_dicts(module)
    assert modules == {} and sorted(params) == ["bias", "weight"] and sorted(buffers) == ["scale"]
    module.register_buffer("mask", torch.ones(1), persistent=False)
    assert compat.non_persistent_buffers(module) == {"mask"}
    params["weight"] = nn.Parameter(torch.zeros(1, 2))  # a write there is what forward reads
    assert module(torch.ones(1, 2)).item() == pytest.approx(module.bias.item())


def test_compiled_original() -> None:
    inner = nn.Linear(2, 2)
    with warnings.catch_warnings():  # torch.compile's first import warns about torch.jit, not about us
        warnings.simplefilter("ignore", DeprecationWarning)
        compiled = torch.compile(inner)
    assert compat.compiled_original(compiled) is inner
    assert compat.compiled_original(inner) is None


def test_incompatible_keys_is_what_load_state_dict_returns() -> None:
    keys = compat.incompatible_keys(["a"], [])
    assert type(keys) is type(nn.Linear(1, 1).load_state_dict(nn.Linear(1, 1).state_dict()))
    assert (keys.missing_keys, keys.unexpected_keys) == (["a"], [])


def test_view_base_on_meta_and_real_tensors() -> None:
    for device in ("cpu", "meta"):
        weight = torch.zeros(3, 4, device=device)
        assert compat.view_base(weight) is weight
        assert compat.view_base(weight.t()) is weight
        assert compat.view_base(weight.t()[1:]) is weight  # a view of a view: the root


def test_fake_tensors_have_shapes_and_no_storage() -> None:
    with compat.fake_tensors():
        net = nn.Linear(4096, 4096)  # 64 MiB if it were real
        out = net(torch.zeros(3, 4096))
        assert type(net.weight).__name__ == "FakeTensor" and net.weight.device.type == "cpu"
        assert out.shape == (3, 4096) and type(out).__name__ == "FakeTensor"
    with pytest.raises(Exception, match="_local_scalar_dense"):
        net.weight.sum().item()  # no values to read


def test_is_dtensor_on_plain_values() -> None:
    assert not compat.is_dtensor(torch.zeros(1))
    assert not compat.is_dtensor(nn.Parameter(torch.zeros(1)))
    assert not compat.is_dtensor("DTensor")


def test_the_process_group_apis_on_two_real_ranks() -> None:
    reports = harness.run(compat_workers.private_apis)
    assert [r["default_store"] for r in reports] == ["here", "here"]
    assert reports[0]["rebuild_ddp_buckets"] == reports[1]["rebuild_ddp_buckets"]
    assert [r["is_dtensor"] for r in reports] == [[True, False], [True, False]]
    assert [r["local_rows"] for r in reports] == [[0, 3], [3, 5]]
    assert [r["dtensor_local"] for r in reports] == [[True, True, True]] * 2
    assert [r["flatten_mesh"] for r in reports] == [[[0, 1], [0, 1]]] * 2
    assert all(r["set_group_timeout"] for r in reports)


# A private name of torch's: an attribute or module segment with one leading underscore, reached
# from torch (torch.x._y, tdist.distributed_c10d._y) or an object's private torch slot.
_PRIVATE = re.compile(
    r"(torch(\.\w+)*\._[A-Za-z]\w*|distributed_c10d\._\w+|\.reducer\._\w+|\._orig_mod\b"
    r"|\._(modules|parameters|buffers|num_samples|non_persistent_buffers_set)\b|_set_pg_timeout)"
)


def _code_without_docs(source: str) -> str:
    """The source with docstrings and comments removed: a private name mentioned in prose is no use."""
    tree = ast.parse(source)
    lines = source.splitlines()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                for i in range(body[0].lineno - 1, body[0].end_lineno or body[0].lineno):
                    lines[i] = ""
    return "\n".join(line.split("#", 1)[0] for line in lines)


def test_no_other_module_touches_a_private_torch_name() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}: {match.group(0)}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_torch_compat.py"
        for match in _PRIVATE.finditer(_code_without_docs(path.read_text()))
    ]
    assert not found, "private torch names outside faccel/_torch_compat.py:\n" + "\n".join(found)


def test_the_scan_sees_a_private_name() -> None:
    code = _code_without_docs(
        '"""torch._x in prose."""\nstore = tdist.distributed_c10d._get_default_store()\n'
    )
    assert [m.group(0) for m in _PRIVATE.finditer(code)] == ["distributed_c10d._get_default_store"]


def test_pipelining_metadata_error_is_what_torchs_stages_raise() -> None:
    from torch.distributed.pipelining import _utils

    assert compat.pipelining_metadata_error() is _utils.PipeliningMetadataError
