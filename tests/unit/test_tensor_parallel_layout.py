"""Tensor-parallel shard geometry (ucformat.layout.tensor_parallel) against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucformat.errors import LayoutMismatchError
from ucformat.layout.tensor_parallel import Piece, ShardMap, row_major_strides, split_pieces


def _brute_shard(logical: np.ndarray, dim: int, widths: list[list[int]], rank: int) -> np.ndarray:
    """Rank ``rank``'s shard by numpy slicing: its width of each sub-parameter, concatenated."""
    parts, start = [], 0
    for sub in widths:
        low = start + sum(sub[:rank])
        parts.append(np.take(logical, range(low, low + sub[rank]), axis=dim))
        start += sum(sub)
    return np.concatenate(parts, axis=dim)


@st.composite
def _splits(draw: st.DrawFn) -> tuple[tuple[int, ...], int, list[list[int]]]:
    ranks = draw(st.integers(1, 4))
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    subs = draw(st.integers(1, 3))
    widths = [
        draw(st.lists(st.integers(0, 4), min_size=ranks, max_size=ranks)) for _ in range(subs)
    ]
    shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
    shape[dim] = sum(sum(w) for w in widths)
    return tuple(shape), dim, widths


@settings(max_examples=200, deadline=None)
@given(_splits(), st.data())
def test_runs_and_translate_match_numpy(
    split: tuple[tuple[int, ...], int, list[list[int]]], data: st.DataObject
) -> None:
    shape, dim, widths = split
    logical = np.arange(int(np.prod(shape))).reshape(shape)
    for rank, pieces in enumerate(split_pieces(shape, dim, widths)):
        want = _brute_shard(logical, dim, widths, rank).reshape(-1)
        shard_shape = list(shape)
        shard_shape[dim] = sum(w[rank] for w in widths)
        shard = ShardMap.build(shape, shard_shape, pieces, "w")
        start = data.draw(st.integers(0, want.size))
        length = data.draw(st.integers(0, want.size - start))
        got = np.full(length, -1)
        for run in shard.translate(start, length):
            got[run.shard_start : run.shard_start + run.length] = logical.reshape(-1)[
                run.logical_start : run.logical_start + run.length
            ]
        assert (got == want[start : start + length]).all()


def test_row_split_is_one_run_per_row_and_column_split_one_run() -> None:
    (col0, _), (row0, _) = split_pieces((4, 6), 0, [[2, 2]]), split_pieces((4, 6), 1, [[3, 3]])
    assert len(ShardMap.build((4, 6), (2, 6), col0, "c").runs) == 1
    assert len(ShardMap.build((4, 6), (4, 3), row0, "r").runs) == 4


def test_gap_in_shard_is_refused() -> None:
    piece = Piece((2, 3), 0, row_major_strides((4, 3)), 0, row_major_strides((2, 3)))
    with pytest.raises(LayoutMismatchError, match="cover 6 elements of a shard of shape"):
        ShardMap.build((4, 3), (3, 3), [piece], "w")
    shifted = Piece((2, 3), 0, (3, 1), 3, (3, 1))
    with pytest.raises(LayoutMismatchError, match="uncovered"):
        ShardMap.build((4, 3), (3, 3), [shifted], "w")
