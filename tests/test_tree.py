"""The one container walker: laws over every container kind, and the bugs it replaced."""

from __future__ import annotations

import json
from collections import OrderedDict, namedtuple

import pytest
import torch
from hypothesis import given
from torch import nn

from faccel._tree import MISSING, children, flatten_with_paths, map_tensors, paired_leaves, rebuild, to_plain
from tests.strategies import Pair, Record, mixed_trees, plain_trees, tensor_trees


@given(mixed_trees)
def test_flatten_then_rebuild_gives_back_the_same_tree(tree: object) -> None:
    leaves, paths, spec = flatten_with_paths(tree)
    rebuilt = rebuild(tree, leaves)
    again, _, spec_again = flatten_with_paths(rebuilt)
    assert spec_again == spec
    assert all(a is b for a, b in zip(leaves, again, strict=True))
    assert len(set(paths)) == len(paths)  # every leaf has its own name for error messages
    assert type(rebuilt) is type(tree)


@given(mixed_trees)
def test_map_tensors_is_rebuild_of_the_mapped_leaves(tree: object) -> None:
    def double(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    leaves, _, spec = flatten_with_paths(tree)
    expected = [double(x) if isinstance(x, torch.Tensor) else x for x in leaves]
    mapped, _, mapped_spec = flatten_with_paths(map_tensors(double, tree))
    assert mapped_spec == spec
    assert len(mapped) == len(expected)
    for got, want in zip(mapped, expected, strict=True):
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want)
        else:
            assert got is want


@given(mixed_trees)
def test_a_tree_walked_with_itself_pairs_every_leaf_with_itself(tree: object) -> None:
    leaves, paths, _ = flatten_with_paths(tree)
    pairs = list(paired_leaves(tree, tree))
    assert [p for p, _, _ in pairs] == paths
    assert all(a is leaf and b is leaf for (_, a, b), leaf in zip(pairs, leaves, strict=True))


@given(tensor_trees)
def test_against_a_leaf_every_leaf_below_is_unmatched(tree: object) -> None:
    pairs = list(paired_leaves(tree, 5))
    if children(tree) is None:
        assert pairs == [("tree", tree, 5)]
    else:
        assert all(other is MISSING for _, _, other in pairs)


def test_paired_leaves_matches_names_and_sequences_of_one_length_only() -> None:
    live = {"w": torch.ones(1), "seq": [torch.ones(1), torch.ones(1)], "nt": Pair(1, 2)}
    saved = {"w": "text", "seq": [0], "nt": (7, 8), "extra": 9}
    got = {path: other for path, _, other in paired_leaves(live, saved)}
    assert got == {
        "tree['w']": "text",
        "tree['seq'][0]": MISSING,
        "tree['seq'][1]": MISSING,
        "tree['nt'].a": 7,  # a named tuple pairs with a plain tuple of its length, as JSON gives it back
        "tree['nt'].b": 8,
    }


@given(plain_trees)
def test_to_plain_is_what_json_gives_back(tree: object) -> None:
    try:
        text = json.dumps(tree)
    except (TypeError, ValueError):  # bytes, non-string keys: not JSON at all
        return
    plain = to_plain(tree)
    assert json.dumps(plain) == text

    def only_json_containers(node: object) -> bool:
        if isinstance(node, dict):
            return type(node) is dict and all(only_json_containers(v) for v in node.values())
        if isinstance(node, list | tuple):
            return type(node) is list and all(only_json_containers(v) for v in node)
        return True

    assert only_json_containers(plain)


def test_every_container_kind_is_named_in_paths_and_structure() -> None:
    tree = {
        "pair": Pair(torch.zeros(1), [1]),
        "rec": Record(first=torch.ones(1)),
        "od": OrderedDict(k=(torch.ones(1),)),
    }
    _, paths, spec = flatten_with_paths(tree)
    assert paths == [
        "tree['pair'].a",
        "tree['pair'].b[0]",
        "tree['rec'].first",
        "tree['rec'].second",
        "tree['od']['k'][0]",
    ]
    expected = "{'pair': Pair(a=T, b=[<int>]), 'rec': Record(first=T, second=<NoneType>), "
    expected += "'od': OrderedDict{'k': (T,)}}"
    assert spec == expected


def test_to_device_moves_tensors_inside_records_and_named_tuples() -> None:
    import faccel

    batch = {
        "rec": Record(first=torch.ones(1, dtype=torch.float64), second="id"),
        "nt": Pair(torch.zeros(1), 3),
    }
    moved = faccel.to_device(batch, torch.device("meta"))
    assert type(moved["rec"]) is Record and moved["rec"].second == "id"
    assert moved["rec"].first.device.type == "meta" and moved["nt"].a.device.type == "meta"
    assert type(moved["nt"]) is Pair and moved["nt"].b == 3


Output = namedtuple("Output", ["logits", "aux"])


class _NamedOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> Output:
        y = self.linear(x)
        return Output(logits=y, aux=y.sum())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_loss_and_grad_under_low_precision_keeps_a_named_tuple_output(precision: str) -> None:
    # Before the one walker, loss_and_grad rebuilt a named tuple from a generator and raised.
    import faccel

    torch.manual_seed(0)
    dist = faccel.detect({}, precision=precision)
    model = _NamedOutput()
    params, buffers = faccel.func.model_params(dist, model)

    def loss_fn(out: Output) -> torch.Tensor:
        assert type(out) is Output and out.logits.dtype == torch.float32
        return out.logits.square().mean() + out.aux

    loss, grads = faccel.func.loss_and_grad(dist, model, loss_fn)(params, buffers, torch.ones(2, 3))
    assert loss.dtype == torch.float32 and set(grads) == set(params)
    with torch.autocast("cpu", dtype=dist.autocast_dtype):
        y = torch.func.functional_call(model, (params, buffers), (torch.ones(2, 3),)).logits
    reference = y.float().square().mean() + y.float().sum()
    assert torch.equal(loss, reference)
