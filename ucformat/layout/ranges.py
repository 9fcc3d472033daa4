"""Interval algebra on flat element ranges, and their mapping onto N-d boxes.

All ranges are half-open ``[start, stop)`` over the row-major flattening of a tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from math import prod

from ucformat.errors import CoverageError

__all__ = [
    "Rect",
    "box_rect",
    "check_tiling",
    "chunk_cover",
    "flat_range_to_boxes",
    "intersect",
    "intersect_boxes",
    "union_cover",
]

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


#: Half-open ``(low, high)`` cells per dimension of a grid.
Rect = tuple[tuple[int, int], ...]


def intersect_boxes(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes (unit-step slices), or None if they do not overlap.

    >>> intersect_boxes((slice(0, 4), slice(2, 6)), (slice(3, 8), slice(0, 3)))
    (slice(3, 4, None), slice(2, 3, None))
    """
    out = []
    for x, y in zip(a, b, strict=True):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def box_rect(box: Box, block: Sequence[int]) -> Rect:
    """The cells of a regular grid of ``block``-shaped cells that a (non-empty) box touches."""
    return tuple(
        (piece.start // size, (piece.stop - 1) // size + 1)
        for piece, size in zip(box, block, strict=True)
    )


def union_cover(rects: Iterable[Rect]) -> list[Rect]:
    """Disjoint rects whose union is exactly the union of ``rects`` (a sweep over dim 0, then
    recursively over the rest; consecutive slabs with the same cross-section merge).

    >>> union_cover([((0, 2), (0, 2)), ((1, 3), (1, 3))])
    [((0, 1), (0, 2)), ((1, 2), (0, 3)), ((2, 3), (1, 3))]
    """
    items = [r for r in rects if all(lo < hi for lo, hi in r)]
    if not items:
        return []
    if not items[0]:
        return [()]
    distinct = set(items)
    if len(distinct) == 1:
        return [items[0]]
    opening: dict[int, list[Rect]] = {}
    closing: dict[int, list[Rect]] = {}
    for rect in distinct:
        opening.setdefault(rect[0][0], []).append(rect[1:])
        closing.setdefault(rect[0][1], []).append(rect[1:])
    cuts = sorted({*opening, *closing})
    active: dict[Rect, int] = {}
    slabs: list[tuple[int, int, frozenset[Rect]]] = []
    for low, high in itertools.pairwise(cuts):
        for tail in closing.get(low, ()):
            active[tail] -= 1
            if not active[tail]:
                del active[tail]
        for tail in opening.get(low, ()):
            active[tail] = active.get(tail, 0) + 1
        if not active:
            continue
        key = frozenset(active)
        if slabs and slabs[-1][1] == low and slabs[-1][2] == key:
            slabs[-1] = (slabs[-1][0], high, key)
        else:
            slabs.append((low, high, key))
    covers: dict[frozenset[Rect], list[Rect]] = {}
    out: list[Rect] = []
    for low, high, key in slabs:
        if key not in covers:
            covers[key] = union_cover(key)
        out += [((low, high), *tail) for tail in covers[key]]
    return out


def chunk_cover(
    shape: Sequence[int], chunk_shape: Sequence[int], ranges: Iterable[tuple[int, int]]
) -> list[Box]:
    """Disjoint boxes, each a block of whole chunks clipped to the array, holding exactly the
    chunks that hold an element of the flat ``ranges`` (any chunk shape).

    Reading these boxes fetches every chunk a read of the ranges needs once, and no other.

    >>> chunk_cover((4, 8), (2, 4), [(9, 11)])
    [(slice(0, 2, None), slice(0, 4, None))]
    >>> chunk_cover((4, 8), (2, 4), [(6, 10)])
    [(slice(0, 2, None), slice(0, 8, None))]
    """
    rects = [
        box_rect(box, chunk_shape)
        for start, stop in ranges
        for box in flat_range_to_boxes(shape, start, stop)
    ]
    return [
        tuple(
            slice(lo * size, min(hi * size, dim))
            for (lo, hi), size, dim in zip(rect, chunk_shape, shape, strict=True)
        )
        for rect in union_cover(rects)
    ]
