"""Properties of the DTensor shard math (ucformat.layout.dtensor) against brute-force models.

The model of torch's ``Shard(0)`` split: the rows, as an explicit list, cut into consecutive
pieces of ``ceil(len / parts)`` along each sharding mesh dimension in turn (what
``torch.chunk`` gives, padded with empty pieces); replicas hold the same rows.
"""

from __future__ import annotations

import itertools
from math import ceil, prod

from hypothesis import given, settings
from hypothesis import strategies as st

from ucformat.layout.chunking import ChunkPolicy, aligned_chunking, choose_chunking
from ucformat.layout.dtensor import (
    local_flat_range,
    local_rows,
    owners,
    split_rows,
)
from ucformat.layout.ownership import writers_by_holdings
from ucformat.layout.ranges import check_tiling
from ucformat.write.plan import shard_regions

FAST = settings(max_examples=200, deadline=None)

meshes = st.sampled_from([((1,), (0,)), ((2,), (0,)), ((3,), (0,)), ((4,), (0,)), ((7,), (0,)),
                          ((2, 2), (None, 0)), ((2, 3), (None, 0)), ((3, 2), (0, 0)),
                          ((2, 2), (0, None))])  # fmt: skip
shapes = st.lists(st.integers(1, 12), min_size=1, max_size=3).map(tuple)


def _chunks(rows: list[int], parts: int) -> list[list[int]]:
    size = ceil(len(rows) / parts) if rows else 0
    return [rows[i * size : (i + 1) * size] for i in range(parts)]


def _brute_rows(dim0: int, mesh: tuple[int, ...], dims: tuple[int | None, ...],
                coord: tuple[int, ...]) -> list[int]:  # fmt: skip
    rows = list(range(dim0))
    for size, dim, c in zip(mesh, dims, coord, strict=True):
        if dim == 0:
            rows = _chunks(rows, size)[c]
    return rows


@FAST
@given(st.integers(0, 40), st.integers(1, 9), st.data())
def test_split_rows_is_torch_chunking(rows: int, parts: int, data: st.DataObject) -> None:
    index = data.draw(st.integers(0, parts - 1))
    start, stop = split_rows(rows, parts, index)
    assert list(range(start, stop)) == _chunks(list(range(rows)), parts)[index]


@FAST
@given(shapes, meshes)
def test_local_ranges_match_brute_force_and_owners_tile(
    shape: tuple[int, ...], mesh: tuple[tuple[int, ...], tuple[int | None, ...]]
) -> None:
    mesh_shape, dims = mesh
    inner = prod(shape[1:])
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        rows = _brute_rows(shape[0], mesh_shape, dims, coord)
        start, stop = local_rows(shape[0], mesh_shape, dims, coord)
        assert list(range(start, stop)) == rows
        flat = local_flat_range(shape, mesh_shape, dims, coord)
        assert flat == (start * inner, stop * inner)
    ranks = list(range(100, 100 + prod(mesh_shape)))
    found = owners(shape, mesh_shape, dims, ranks)
    check_tiling("owners", prod(shape), ((o.start, o.stop) for o in found))
    assert len({o.rank for o in found}) == len(found)  # one replica each


@FAST
@given(shapes, st.integers(1, 4), st.sampled_from([1, 2, 4]), st.sampled_from([8, 24, 64, 200]))
def test_every_unit_has_one_writer_and_aligned_layouts_need_no_transfers(
    shape: tuple[int, ...], world: int, item: int, chunk_bytes: int
) -> None:
    holders = owners(shape, (world,), (0,), list(range(world)))
    inner = prod(shape[1:])
    policy = ChunkPolicy(chunk_bytes, chunk_bytes * 4)
    chunking = aligned_chunking(shape, item, policy, [o.start // inner for o in holders])
    default = choose_chunking(shape, item, policy)
    assert all(s % c == 0 for s, c in zip(chunking.shard_shape, chunking.chunk_shape, strict=True))
    assert prod(chunking.chunk_shape) * 4 >= prod(default.chunk_shape) or chunking == default
    units = []
    for region in shard_regions(list(shape), list(chunking.shard_shape)):
        start = 0
        for dim, piece in zip(shape, region, strict=True):
            start = start * dim + piece.start
        units.append((start, start + prod(p.stop - p.start for p in region)))
    pieces = [
        [
            (o.rank, max(a, o.start), min(b, o.stop))
            for o in holders
            if max(a, o.start) < min(b, o.stop)
        ]
        for a, b in units
    ]
    held = [{rank: stop - start for rank, start, stop in unit} for unit in pieces]
    writers = writers_by_holdings(held, max(o.rank for o in holders) + 1)
    for (start, stop), unit, writer in zip(units, pieces, writers, strict=True):
        check_tiling("unit", stop - start, ((a - start, b - start) for _, a, b in unit))
        mine = sum(b - a for rank, a, b in unit if rank == writer)
        assert mine == max(b - a for _, a, b in unit)
    if chunking != default or len(holders) == 1:
        assert all(len(unit) == 1 for unit in pieces), (chunking, holders)


def test_aligned_chunking_examples() -> None:
    policy = ChunkPolicy(tp_max=1)  # flat-contiguous chunks
    # 1024 x 1024 fp32 at 2 ranks: 16-row chunks, shards end on the 512-row boundary.
    assert aligned_chunking((1024, 1024), 4, policy, [0, 512]).shard_shape == (512, 1024)
    # at 3 ranks (342-row shards) the chunks shrink to 9 rows, a divisor of 342.
    chunking = aligned_chunking((1024, 1024), 4, policy, [0, 342, 684])
    assert chunking.chunk_shape == (9, 1024) and 342 % chunking.shard_shape[0] == 0
    # a boundary with no large divisor (a prime row count) keeps the policy's chunks.
    assert aligned_chunking((1024, 1024), 4, policy, [0, 509]) == choose_chunking(
        (1024, 1024), 4, policy
    )
    # box chunks (8, 128): their rows shrink to 6, shards are 342 whole rows.
    boxed = aligned_chunking((1024, 1024), 4, ChunkPolicy(), [0, 342, 684])
    assert boxed.chunk_shape == (6, 128) and boxed.shard_shape == (342, 1024)
