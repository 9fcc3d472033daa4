"""ucformat.layout.boxes against brute force: every element of a box, enumerated."""

from __future__ import annotations

import itertools
import random
from math import prod

import pytest

from ucformat.errors import LayoutMismatchError
from ucformat.layout.boxes import Run, chunk_runs, row_chunks


def _flat(shape: tuple[int, ...], index: tuple[int, ...]) -> int:
    offset = 0
    for dim, i in zip(shape, index, strict=True):
        offset = offset * dim + i
    return offset


def _brute(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[int]:
    """Global flat index of every chunk element, in the chunk's row-major order."""
    return [
        _flat(shape, tuple(o + i for o, i in zip(offsets, index, strict=True)))
        for index in itertools.product(*(range(s) for s in sizes))
    ]


def _expand(runs: list[Run]) -> list[int]:
    out: list[int] = []
    for run in runs:
        assert run.chunk_start == len(out)
        out.extend(range(run.start, run.start + run.length))
    return out


@pytest.mark.parametrize(
    ("shape", "offsets", "sizes", "count"),
    [
        ((64, 20), (22, 0), (22, 20), 1),  # FSDP2 dim-0 shard: one run
        ((64, 20), (44, 0), (20, 20), 1),  # uneven last shard
        ((6, 8), (2, 4), (3, 4), 3),  # a 2-D block: one run per row
        ((4, 3, 5), (0, 1, 0), (4, 2, 5), 4),
        ((5,), (3,), (2,), 1),
        ((), (), (), 1),  # 0-d (Adam's step)
        ((3, 4), (3, 0), (0, 4), 0),  # an empty shard
    ],
)
def test_chunk_runs_examples(
    shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], count: int
) -> None:
    runs = chunk_runs(shape, offsets, sizes)
    assert len(runs) == count
    assert _expand(runs) == _brute(shape, offsets, sizes)


def test_chunk_runs_random_boxes_tile_like_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        offsets = tuple(rng.randint(0, d - 1) for d in shape)
        sizes = tuple(rng.randint(1, d - o) for d, o in zip(shape, offsets, strict=True))
        runs = chunk_runs(shape, offsets, sizes)
        assert _expand(runs) == _brute(shape, offsets, sizes)
        assert sum(r.length for r in runs) == prod(sizes)


@pytest.mark.parametrize(
    ("shape", "offsets", "sizes"),
    [((4, 4), (0,), (4,)), ((4, 4), (2, 0), (3, 4)), ((4,), (-1,), (2,))],
)
def test_chunk_runs_refuses_boxes_outside_the_tensor(
    shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> None:
    with pytest.raises(LayoutMismatchError):
        chunk_runs(shape, offsets, sizes)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("shape", [(64, 20), (5,), (2, 3), (3, 1, 4)])
@pytest.mark.parametrize("max_elements", [1, 7, 40, 10**9])
def test_row_chunks_are_fsdp2_shards_in_bounded_pieces(
    shape: tuple[int, ...], world_size: int, max_elements: int
) -> None:
    pieces = row_chunks(shape, world_size, max_elements)
    rows, row = shape[0], prod(shape[1:])
    per_rank = -(-rows // world_size)
    covered = [p for piece in pieces for p in range(piece.row_start, piece.row_stop)]
    assert covered == list(range(rows))  # in order, no hole, no overlap
    for piece in pieces:
        assert piece.row_start // per_rank == piece.rank == (piece.row_stop - 1) // per_rank
        assert (piece.row_stop - piece.row_start) * row <= max(max_elements, row)


def test_row_chunks_scalar_and_empty() -> None:
    assert [(c.rank, c.row_start, c.row_stop) for c in row_chunks((), 3, 10)] == [(0, 0, 1)]
    assert row_chunks((0, 4), 2, 10) == []
