"""Interval algebra and flat-range-to-box mapping."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ucformat.errors import CoverageError
from ucformat.layout.ranges import check_tiling, flat_range_to_boxes, intersect


def test_intersect() -> None:
    assert intersect((0, 10), (5, 20)) == (5, 10)
    assert intersect((0, 5), (5, 10)) is None


def test_tiling_accepts_exact_cover_in_any_order() -> None:
    check_tiling("p", 10, [(5, 10), (0, 3), (3, 5)])
    check_tiling("empty", 0, [])


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ([(0, 3), (4, 10)], "param 'w': elements [3, 4) of 10 are held by no shard"),
        ([(0, 5), (4, 10)], "param 'w': elements [4, 5) are held by two shards"),
        ([(0, 12)], "param 'w': fragments reach element 12, past its 10."),
        ([(0, 8)], "param 'w': elements [8, 10) of 10 are held by no shard"),
    ],
)
def test_tiling_errors_name_the_range(runs: list[tuple[int, int]], message: str) -> None:
    with pytest.raises(CoverageError, match=re.escape(message)):
        check_tiling("param 'w'", 10, runs)


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5), (1, 1, 9), ()])
def test_boxes_reassemble_every_range(shape: tuple[int, ...]) -> None:
    data = np.arange(int(np.prod(shape))).reshape(shape)
    total = data.size
    for start in range(total + 1):
        for stop in range(start, total + 1):
            boxes = flat_range_to_boxes(shape, start, stop)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            pieces = [data[box].reshape(-1) for box in boxes]
            got = np.concatenate(pieces) if pieces else np.empty(0, dtype=data.dtype)
            np.testing.assert_array_equal(got, np.arange(start, stop))


def test_boxes_reject_out_of_range() -> None:
    with pytest.raises(ValueError, match="outside"):
        flat_range_to_boxes((3,), 0, 4)
