"""The plan of a sharded save_model: which rank writes which tensor, into which file (_hf/_assign)."""

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
