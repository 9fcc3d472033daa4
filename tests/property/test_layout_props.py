"""Properties of the layout math: ZeRO partitions, flat ranges, chunk grids, chunk shapes.

Each property is checked against a brute-force model (numpy index arrays, explicit element
sets) for random shapes, world sizes and paddings.
"""

from __future__ import annotations

from math import prod

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ucformat.layout.chunking import ChunkPolicy, choose_chunking, chunk_aligned_range
from ucformat.layout.grid import (
    chunk_box,
    chunk_flat_range,
    chunks_in_box,
    grid_shape,
    is_flat_block,
    shard_chunks,
    shard_grid,
)
from ucformat.layout.partition import (
    PartitionedFlatLayout,
    PerParamLayout,
    alignment_paddings,
    zero3_sub_groups,
)
from ucformat.layout.ranges import check_tiling, flat_range_to_boxes

FAST = settings(max_examples=150, deadline=None)

numels = st.lists(st.integers(0, 40), min_size=1, max_size=8)
world_sizes = st.integers(1, 8)
shapes = st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple)


def _params(sizes: list[int]) -> list[tuple[str, int]]:
    return [(f"p{i}", n) for i, n in enumerate(sizes)]


@st.composite
def zero12_layouts(draw: st.DrawFn) -> PartitionedFlatLayout:
    sizes = draw(numels)
    pads = draw(
        st.one_of(st.none(), st.lists(st.integers(0, 7), min_size=len(sizes), max_size=len(sizes)))
    )
    return PartitionedFlatLayout.build(_params(sizes), draw(world_sizes), pads)


@given(zero12_layouts())
@FAST
def test_zero12_fragments_tile_every_param_exactly(layout: PartitionedFlatLayout) -> None:
    size = layout.partition_size
    assert layout.total % (2 * layout.world_size) == 0 and layout.total >= layout.used
    assert layout.total - layout.used < 2 * layout.world_size
    by_param: dict[str, list[tuple[int, int]]] = {slot.name: [] for slot in layout.slots}
    for rank in range(layout.world_size):
        held = np.zeros(size, dtype=bool)
        for fragment in layout.fragments(rank):
            slot = next(s for s in layout.slots if s.name == fragment.name)
            # the fragment's place in the rank's partition is its place in the flat buffer
            assert rank * size + fragment.partition_start == slot.offset + fragment.param_start
            assert fragment.partition_start >= 0
            assert fragment.partition_start + fragment.length <= size
            assert fragment.partition_start + fragment.length <= layout.valid_length(rank)
            assert not held[
                fragment.partition_start : fragment.partition_start + fragment.length
            ].any()
            held[fragment.partition_start : fragment.partition_start + fragment.length] = True
            by_param[fragment.name].append((fragment.param_start, fragment.param_stop))
    for slot in layout.slots:
        check_tiling(slot.name, slot.numel, by_param[slot.name])


@given(numels, world_sizes)
@FAST
def test_zero3_fragments_tile_every_param_exactly(sizes: list[int], world_size: int) -> None:
    layout = PerParamLayout.build(_params(sizes), world_size)
    assert layout.partition_size == sum(-(-n // world_size) for n in sizes)
    by_param: dict[str, list[tuple[int, int]]] = {slot.name: [] for slot in layout.slots}
    for rank in range(world_size):
        held = np.zeros(layout.partition_size, dtype=bool)
        for fragment in layout.fragments(rank):
            piece = layout.piece_size(
                next(s.numel for s in layout.slots if s.name == fragment.name)
            )
            assert fragment.param_start == rank * piece and fragment.length <= piece
            end = fragment.partition_start + fragment.length
            assert end <= layout.partition_size and not held[fragment.partition_start : end].any()
            held[fragment.partition_start : end] = True
            by_param[fragment.name].append((fragment.param_start, fragment.param_stop))
    for slot in layout.slots:
        check_tiling(slot.name, slot.numel, by_param[slot.name])


@given(numels, st.sampled_from([1, 2, 4, 8]))
@FAST
def test_alignment_paddings_align_every_param_start(sizes: list[int], element_size: int) -> None:
    pads = alignment_paddings(sizes, element_size)
    align = 16 // np.gcd(16, element_size)
    assert pads[-1] == 0 and all(0 <= pad < align for pad in pads)
    offset = 0
    for numel, pad in zip(sizes, pads, strict=True):
        assert offset % align == 0
        offset += numel + pad


@given(numels, world_sizes, st.integers(1, 60))
@FAST
def test_zero3_sub_groups_partition_the_params_in_order(
    sizes: list[int], world_size: int, sub_group_size: int
) -> None:
    params = _params(sizes)
    groups = zero3_sub_groups(params, world_size, sub_group_size)
    assert [name for group in groups for name in group] == [name for name, _ in params]
    pieces = {name: -(-numel // world_size) for name, numel in params}
    for group in groups[:-1]:
        assert sum(pieces[n] for n in group) >= sub_group_size
    for group in groups:
        assert sum(pieces[n] for n in group[:-1]) < sub_group_size


@st.composite
def shape_and_range(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int]:
    shape = draw(shapes)
    total = prod(shape)
    start = draw(st.integers(0, total))
    return shape, start, draw(st.integers(start, total))


@given(shape_and_range())
@FAST
def test_flat_range_to_boxes_covers_exactly_the_range(
    case: tuple[tuple[int, ...], int, int],
) -> None:
    shape, start, stop = case
    index = np.arange(prod(shape)).reshape(shape)
    boxes = flat_range_to_boxes(shape, start, stop)
    got = np.concatenate([index[box].reshape(-1) for box in boxes]) if boxes else np.array([])
    assert got.tolist() == list(range(start, stop))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


@st.composite
def shape_and_chunks(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A shape with the chunk and shard shapes choose_chunking gives it."""
    shape = draw(shapes)
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    chunk_bytes = draw(st.integers(1, 256))
    policy = ChunkPolicy(chunk_bytes, chunk_bytes * draw(st.integers(1, 8)))
    chunking = choose_chunking(shape, itemsize, policy)
    return shape, chunking.chunk_shape, chunking.shard_shape


@given(shape_and_chunks(), st.data())
@FAST
def test_chunk_aligned_range_widens_to_the_same_chunks(
    case: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], data: st.DataObject
) -> None:
    shape, chunk, _ = case
    total = prod(shape)
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    low, high = chunk_aligned_range(shape, chunk, start, stop)
    if start == stop or not shape:
        assert (low, high) == (start, stop)
        return
    chunk_of = _chunk_ids(shape, chunk)
    assert low <= start and stop <= high <= total
    assert set(chunk_of[low:high]) == set(chunk_of[start:stop])
    assert low == 0 or chunk_of[low - 1] != chunk_of[low]  # starts on a chunk boundary
    assert high == total or chunk_of[high - 1] != chunk_of[high]  # ends on one


def _chunk_ids(shape: tuple[int, ...], chunk: tuple[int, ...]) -> np.ndarray:
    """The flat-order chunk number of every element (brute force)."""
    coords = np.indices(shape).reshape(len(shape), -1)
    grid = grid_shape(shape, chunk)
    ids = np.zeros(coords.shape[1], dtype=np.int64)
    for axis, (size, count) in enumerate(zip(chunk, grid, strict=True)):
        ids = ids * count + coords[axis] // size
    return ids


@given(st.lists(st.integers(0, 300), min_size=0, max_size=4), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 4096), st.integers(1, 64))  # fmt: skip
@FAST
def test_choose_chunking_gives_flat_blocks_within_budget(
    dims: list[int], itemsize: int, chunk_bytes: int, factor: int
) -> None:
    policy = ChunkPolicy(chunk_bytes, chunk_bytes * factor)
    chunking = choose_chunking(dims, itemsize, policy)
    chunk, shard = chunking.chunk_shape, chunking.shard_shape
    assert len(chunk) == len(shard) == len(dims)
    assert all(c >= 1 for c in chunk) and all(s % c == 0 for s, c in zip(shard, chunk, strict=True))
    if prod(dims) == 0:
        return
    assert is_flat_block(dims, chunk) and is_flat_block(dims, shard, overhang=True)
    chunk_numel = prod(chunk)
    assert chunk_numel * itemsize <= max(itemsize, chunk_bytes)
    assert prod(shard) * itemsize <= max(chunk_numel * itemsize, policy.shard_bytes)
    # a cut dimension is cut into (nearly) equal parts: no chunk row is tiny next to the others
    grid = grid_shape(dims, chunk)
    assert all(d > (g - 1) * c for d, g, c in zip(dims, grid, chunk, strict=True))


@given(shape_and_chunks())
@FAST
def test_chunk_grid_geometry_matches_brute_force(
    case: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
) -> None:
    shape, chunk, shard = case
    if not shape or prod(shape) == 0:
        assert list(shard_grid(shape, shard)) == ([()] if not shape else [])
        return
    ids = _chunk_ids(shape, chunk)
    grid = grid_shape(shape, chunk)
    seen: list[tuple[int, ...]] = []
    for shard_coords in shard_grid(shape, shard):
        members = list(shard_chunks(shape, chunk, shard, shard_coords))
        assert members == list(chunks_in_box(shape, chunk, chunk_box(shape, shard, shard_coords)))
        seen += members
        for coords in members:
            start, stop = chunk_flat_range(shape, chunk, coords)
            number = int(np.ravel_multi_index(coords, grid))
            flat = np.flatnonzero(ids == number)
            # flat-contiguous: the chunk's elements are exactly one flat range
            assert flat.tolist() == list(range(start, stop))
            assert stop - start == prod(s.stop - s.start for s in chunk_box(shape, chunk, coords))
    assert sorted(seen) == sorted(np.ndindex(*grid))
