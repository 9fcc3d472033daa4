"""Chunk-grid geometry: which chunks a box or a shard holds, and where each chunk lies.

An array of ``shape`` is cut into chunks of ``chunk_shape`` (the last ones clipped at the array
edge) and into shards of ``shard_shape``, each a whole number of chunks (docs/format.md §2.2).
Chunks are named by their grid coordinates, e.g. ``(3, 0)``; a 0-d array has one chunk, ``()``.
For the flat-contiguous chunks ucformat writes, every chunk is one flat element range, which is
how :func:`chunk_flat_range` names it in messages. Plain integer arithmetic: no zarr, no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from math import prod

from ucformat.layout.partition import ceil_div

__all__ = [
    "chunk_box",
    "chunk_flat_range",
    "chunks_in_box",
    "grid_shape",
    "is_flat_block",
    "shard_chunks",
    "shard_grid",
]

Box = tuple[slice, ...]
Coords = tuple[int, ...]


def grid_shape(shape: Sequence[int], block_shape: Sequence[int]) -> Coords:
    """Number of blocks (chunks or shards) along each dimension.

    >>> grid_shape((10, 4), (3, 4))
    (4, 1)
    """
    return tuple(ceil_div(dim, block) for dim, block in zip(shape, block_shape, strict=True))


def chunk_box(shape: Sequence[int], chunk_shape: Sequence[int], coords: Coords) -> Box:
    """The region of chunk ``coords``, clipped to the array.

    >>> chunk_box((10, 4), (3, 4), (3, 0))
    (slice(9, 10, None), slice(0, 4, None))
    """
    return tuple(
        slice(c * k, min((c + 1) * k, dim))
        for c, k, dim in zip(coords, chunk_shape, shape, strict=True)
    )


def chunk_flat_range(
    shape: Sequence[int], chunk_shape: Sequence[int], coords: Coords
) -> tuple[int, int]:
    """The flat range from the first to one past the last element of chunk ``coords``.

    For a flat-contiguous chunk (every chunk ucformat writes) these are exactly its elements.

    >>> chunk_flat_range((10, 4), (3, 4), (1, 0))
    (12, 24)
    >>> chunk_flat_range((), (), ())
    (0, 1)
    """
    box = chunk_box(shape, chunk_shape, coords)
    first = last = 0
    for dim, piece in zip(shape, box, strict=True):
        first = first * dim + piece.start
        last = last * dim + piece.stop - 1
    return first, last + 1


def chunks_in_box(shape: Sequence[int], chunk_shape: Sequence[int], box: Box) -> Iterator[Coords]:
    """Coordinates of every chunk that intersects ``box``, in row-major order.

    >>> list(chunks_in_box((10, 4), (3, 4), (slice(2, 7), slice(0, 4))))
    [(0, 0), (1, 0), (2, 0)]
    """
    if not shape:
        yield ()
        return
    ranges = []
    for piece, k, dim in zip(box, chunk_shape, shape, strict=True):
        start, stop, _ = piece.indices(dim)
        if start >= stop:
            return
        ranges.append(range(start // k, ceil_div(stop, k)))
    yield from itertools.product(*ranges)


def shard_grid(shape: Sequence[int], shard_shape: Sequence[int]) -> Iterator[Coords]:
    """Coordinates of every shard of a non-empty array, in row-major order.

    >>> list(shard_grid((10, 4), (6, 4)))
    [(0, 0), (1, 0)]
    """
    if prod(shape) == 0 and shape:
        return
    yield from itertools.product(*(range(n) for n in grid_shape(shape, shard_shape)))


def shard_chunks(
    shape: Sequence[int], chunk_shape: Sequence[int], shard_shape: Sequence[int], shard: Coords
) -> Iterator[Coords]:
    """Coordinates of the chunks of shard ``shard`` that lie inside the array.

    >>> list(shard_chunks((10, 4), (3, 4), (6, 4), (1, 0)))
    [(2, 0), (3, 0)]
    """
    box = chunk_box(shape, shard_shape, shard)
    yield from chunks_in_box(shape, chunk_shape, box)


def is_flat_block(shape: Sequence[int], block: Sequence[int], *, overhang: bool = False) -> bool:
    """Whether ``block`` is a flat-contiguous block of ``shape`` (docs/format.md §2.2).

    That is ``(1, ..., 1, k, d_j+1, ..., d_n)``: whole trailing dimensions after one cut one.

    Args:
        shape: the array shape (every dimension positive).
        block: the chunk or shard shape.
        overhang: the block may reach past the array's edge (shards, as zarr allows); it is
            judged by its part inside the array.

    >>> is_flat_block((10, 4), (3, 4)), is_flat_block((10, 4), (3, 2)), is_flat_block((), ())
    (True, False, True)
    >>> is_flat_block((3, 5), (2, 6)), is_flat_block((3, 5), (2, 6), overhang=True)
    (False, True)
    """
    dims, sizes = tuple(shape), tuple(block)
    if len(dims) != len(sizes) or any(size < 1 for size in sizes):
        return False
    if overhang:
        sizes = tuple(min(size, dim) for size, dim in zip(sizes, dims, strict=True))
    for j in range(len(dims)):
        if all(size == 1 for size in sizes[:j]) and sizes[j + 1 :] == dims[j + 1 :]:
            return sizes[j] <= dims[j]
    return not dims
