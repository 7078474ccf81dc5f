"""A sharded save_model in one process: its plan (_hf/_assign) and a rank's writer (_hf/_spread_write)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from faccel._hf._assign import assign, rank_files
from tests.strategies import small_world_sizes

# Tensor lists: unique names, byte sizes from empty tensors to 1 GB, with many equal sizes.
tensor_lists = st.dictionaries(
    st.text("abcdefgh.0123", min_size=1, max_size=12),
    st.one_of(st.integers(0, 1 << 30), st.sampled_from([0, 4, 64, 4096])),
    max_size=60,
)


@given(tensor_lists, small_world_sizes)
def test_every_tensor_goes_to_one_rank_and_no_rank_exceeds_its_share_plus_the_largest_tensor(
    sizes: dict[str, int], world: int
) -> None:
    owner = assign(sizes, world)
    assert list(owner) == list(sizes)  # each tensor exactly once, in the given order
    assert all(0 <= rank < world for rank in owner.values())
    loads = [0] * world
    for name, rank in owner.items():
        loads[rank] += sizes[name]
    largest = max(sizes.values(), default=0)
    assert max(loads) * world <= sum(sizes.values()) + largest * world  # max <= total/world + largest
    # deterministic: a pure function of the names, their order and sizes, and the world size
    assert assign(dict(sizes), world) == owner


@given(tensor_lists, small_world_sizes, st.integers(1, 1 << 31))
def test_each_rank_s_files_hold_its_tensors_in_walk_order_within_the_shard_size(
    sizes: dict[str, int], world: int, max_shard_size: int
) -> None:
    owner = assign(sizes, world)
    walk = sorted(sizes, key=lambda name: -sizes[name] % 7)  # any order every rank shares
    files = rank_files(walk, sizes, owner, world, max_shard_size)
    written = [name for file in files for name in file.names]
    assert sorted(written) == sorted(sizes)  # every tensor in one file
    assert [file.rank for file in files] == sorted(file.rank for file in files)  # numbered rank by rank
    for rank in range(world):
        mine = [name for file in files if file.rank == rank for name in file.names]
        assert mine == [name for name in walk if owner[name] == rank]  # written as the walk meets them
    for file in files:
        assert all(owner[name] == file.rank for name in file.names)
        # a file over the limit holds one tensor alone (as huggingface_hub splits)
        assert len(file.names) <= 1 or sum(sizes[name] for name in file.names) <= max_shard_size
    if not sizes:
        assert [(f.rank, f.names) for f in files] == [(0, ())]


def test_the_largest_tensors_spread_over_the_ranks_first() -> None:
    sizes = {"embed": 100, "h.0": 40, "h.1": 40, "h.2": 40, "norm": 1}
    assert assign(sizes, 2) == {"embed": 0, "h.0": 1, "h.1": 1, "h.2": 1, "norm": 0}  # 101 and 120 bytes
    assert assign(sizes, 1) == dict.fromkeys(sizes, 0)


def test_write_own_streams_this_rank_s_tensors_into_its_files_through_a_small_buffer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch
    from safetensors.torch import load_file

    from faccel._hf._spread_write import OwnFile, write_own
    from faccel._storage._safetensors import header_bytes, plan

    torch.manual_seed(0)
    state = {"a": torch.randn(64, 8), "b": torch.arange(10), "c": torch.randn(3).half(), "d": torch.zeros(0)}
    walk = sorted(state, key=lambda name: -state[name].element_size())  # b, a, c, d
    owner = {"a": 0, "b": 0, "c": 0, "d": 1}  # d is another rank's: gathered, then dropped
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}
    groups = [("one.safetensors", ("b", "a")), ("two.safetensors", ("c",))]
    files = [
        OwnFile(name=n, header=header_bytes(specs, list(g), {"format": "pt"}), names=g) for n, g in groups
    ]
    write_own(state, walk, owner, 0, tmp_path, files, buffer=1)  # one tensor waits at a time
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.safetensors", "two.safetensors"]
    for name, group in groups:
        loaded = load_file(tmp_path / name)
        assert set(loaded) == set(group) and all(torch.equal(loaded[key], state[key]) for key in group)
        # byte for byte what a one-process save writes of the same tensors
        chunks = plan({key: state[key] for key in group}, metadata={"format": "pt"})
        assert (tmp_path / name).read_bytes() == b"".join(bytes(memoryview(c).cast("B")) for c in chunks)


def test_a_failed_write_is_raised_after_the_walk_and_leaves_no_final_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import pytest
    import torch

    from faccel._hf._spread_write import OwnFile, write_own
    from faccel._storage._safetensors import header_bytes

    state = {name: torch.full((256,), float(i)) for i, name in enumerate("abcd")}
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}
    (tmp_path / ".tmp-two.safetensors").mkdir()  # the second file's temporary cannot be written
    (tmp_path / ".tmp-two.safetensors" / "x").write_text("")
    files = [
        OwnFile(name=n, header=header_bytes(specs, list(g), None), names=g)
        for n, g in (("one.safetensors", ("a", "b")), ("two.safetensors", ("c", "d")))
    ]
    with pytest.raises(OSError):
        write_own(state, list(state), dict.fromkeys(state, 0), 0, tmp_path, files, buffer=1)
    assert (tmp_path / "one.safetensors").is_file() and not (tmp_path / "two.safetensors").exists()
