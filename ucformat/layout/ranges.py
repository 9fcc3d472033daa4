"""Interval algebra on flat element ranges, and their mapping onto N-d boxes.

All ranges are half-open ``[start, stop)`` over the row-major flattening of a tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from math import prod

from ucformat.errors import CoverageError

__all__ = ["check_tiling", "flat_range_to_boxes", "intersect"]

Box = tuple[slice, ...]


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The overlap of two ranges, or None if they do not overlap."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def check_tiling(what: str, total: int, runs: Iterable[tuple[int, int]]) -> None:
    """Raise :class:`CoverageError` unless ``runs`` tile ``[0, total)`` exactly.

    Args:
        what: names the tiled thing in the message, e.g. ``"param 'w' state 'exp_avg'"``.
        total: the length to cover.
        runs: ``(start, stop)`` ranges in any order.
    """
    position = 0
    for start, stop in sorted(runs):
        if stop < start or start < 0:
            raise CoverageError(f"{what}: invalid range [{start}, {stop}).")
        if start > position:
            raise CoverageError(
                f"{what}: elements [{position}, {start}) of {total} are held by no shard "
                "(a hole in the source layout)."
            )
        if start < position:
            raise CoverageError(
                f"{what}: elements [{start}, {min(position, stop)}) are held by two shards "
                "(overlapping fragments)."
            )
        position = stop
    if position != total:
        if position > total:
            raise CoverageError(f"{what}: fragments reach element {position}, past its {total}.")
        raise CoverageError(
            f"{what}: elements [{position}, {total}) of {total} are held by no shard "
            "(a hole in the source layout)."
        )


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Split the flat range ``[start, stop)`` of an array of ``shape`` into N-d boxes.

    The boxes are in flat order and their flattened contents, concatenated, are exactly the
    elements ``start .. stop - 1``. There are at most ``2 * ndim - 1`` of them.

    >>> flat_range_to_boxes((3, 4), 2, 9)
    [(slice(0, 1, None), slice(2, 4, None)), (slice(1, 2, None), slice(0, 4, None)), \
(slice(2, 3, None), slice(0, 1, None))]
    """
    total = prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"range [{start}, {stop}) is outside a tensor of {total} elements")
    if start == stop:
        return []
    if len(shape) == 0:
        return [()]
    inner = prod(shape[1:])
    first_row, first_offset = divmod(start, inner)
    last_row, last_offset = divmod(stop, inner)
    rest = tuple(slice(0, dim) for dim in shape[1:])
    if first_row == last_row:
        return [
            (slice(first_row, first_row + 1), *sub)
            for sub in flat_range_to_boxes(shape[1:], first_offset, last_offset)
        ]
    boxes: list[Box] = []
    if first_offset:
        boxes += [
            (slice(first_row, first_row + 1), *sub)
            for sub in flat_range_to_boxes(shape[1:], first_offset, inner)
        ]
        first_row += 1
    if first_row < last_row:
        boxes.append((slice(first_row, last_row), *rest))
    if last_offset:
        boxes += [
            (slice(last_row, last_row + 1), *sub)
            for sub in flat_range_to_boxes(shape[1:], 0, last_offset)
        ]
    return boxes
