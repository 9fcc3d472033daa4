"""Chunk and shard shapes: a pure function of an array's shape, itemsize and byte targets.

Two kinds of inner chunk (docs/format.md §2.2):

* a *flat-contiguous block* ``(1, ..., 1, k, d_{j+1}, ..., d_n)``: a run of whole trailing
  sub-arrays, so a chunk holds consecutive elements of the row-major flattening (the trailing
  dimension may be split into equal parts when one row alone exceeds the target). Every array
  gets these, except
* a *box chunk* ``(r, c)`` for a matrix of at least :attr:`ChunkPolicy.box_min_bytes`:
  ``c = ceil(C / tp_max)`` columns (a row-wise tensor-parallel slice at the largest expected
  TP degree, or an equal part of it when that alone exceeds the chunk target) by ``r`` rows,
  between a sixteenth of the chunk target and the target: the largest ``r`` whose FSDP2 and
  FSDP2 + TP row pieces (``tp`` and ``dp`` powers of two up to ``tp_max`` and ``dp_max``)
  read on average at most :data:`BOX_ROW_TARGET` of the rows they need. Column slices
  (``Shard(1)``) and row slices (``Shard(0)``, FSDP2, ZeRO) of such a matrix then read about
  what they need.

Shards are flat-contiguous in both cases (whole rows of a box-chunked matrix), so

* a shard is one flat range of the array, and the converter fills one shard from the source
  fragments in memory and writes it once, never read-modify-write;
* a flat range ``[a, b)`` of a parameter (what a ZeRO rank owns) touches only the chunks that
  hold its elements (for flat chunks: plus at most one partial chunk at each end).

The targets are bytes of uncompressed data: ``chunk_bytes`` sets the read granularity (and thus
over-read at partition boundaries), ``shard_bytes`` the number of storage objects.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ucformat.layout.partition import ceil_div
from ucformat.layout.ranges import chunk_cover

__all__ = [
    "ChunkPolicy",
    "Chunking",
    "aligned_chunking",
    "box_chunk_shape",
    "choose_chunking",
    "chunk_aligned_range",
    "flat_block_shape",
    "fragment_rows",
    "is_flat_chunking",
    "shard_block",
]

#: A box chunk holds at least ``chunk_bytes // BOX_MIN_FRACTION`` bytes (small matrices would
#: otherwise get chunks of a few hundred bytes, and an index as large as a tenth of the data).
BOX_MIN_FRACTION = 16


@dataclass(frozen=True)
class ChunkPolicy:
    """Byte targets for inner chunks and shards (uncompressed), and the parallel degrees that
    box chunks are aligned to.

    The defaults come from the simulated tables in docs/benchmarks.md (read amplification of
    large-world-size loads by chunk and shard size; of tensor-parallel loads by chunk shape).
    A shard is also the converter's unit of memory: it holds about ``workers x shard_bytes``.
    ``tp_max = 1`` turns box chunks off (every chunk flat-contiguous, as before format 2.2).
    """

    chunk_bytes: int = 64 * 1024
    shard_bytes: int = 16 * 1024 * 1024
    #: The largest tensor-parallel degree reads should stay lean at (box chunk columns).
    tp_max: int = 8
    #: The largest data-parallel degree of an FSDP2 + TP load (box chunk rows).
    dp_max: int = 64
    #: Matrices of at least this many bytes get box chunks.
    box_min_bytes: int = 1024 * 1024

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.shard_bytes < self.chunk_bytes:
            raise ValueError(
                f"need 1 <= chunk_bytes <= shard_bytes, got {self.chunk_bytes}, {self.shard_bytes}"
            )
        if self.tp_max < 1 or self.dp_max < 1:
            raise ValueError(f"need tp_max, dp_max >= 1, got {self.tp_max}, {self.dp_max}")


@dataclass(frozen=True)
class Chunking:
    """Chunk and shard shapes for one array."""

    chunk_shape: tuple[int, ...]
    shard_shape: tuple[int, ...]

    @property
    def chunk_elements(self) -> int:
        """Elements per inner chunk."""
        total = 1
        for dim in self.chunk_shape:
            total *= dim
        return total


def flat_block_shape(shape: Sequence[int], target: int) -> tuple[int, ...]:
    """The largest flat-contiguous block shape of at most about ``target`` elements.

    Trailing dimensions are taken whole while they fit; the next one is cut into equal-sized
    parts of at most ``target // trailing`` rows (at least 1); leading dimensions are 1.

    >>> flat_block_shape((4096, 5120), 16384)
    (3, 5120)
    >>> flat_block_shape((10, 20000), 8192)
    (1, 6667)
    """
    dims = tuple(shape)
    if any(dim == 0 for dim in dims):
        return tuple(max(dim, 1) for dim in dims)
    trailing = 1
    for index in range(len(dims) - 1, -1, -1):
        if trailing * dims[index] > target:
            rows = max(1, target // trailing)
            rows = ceil_div(dims[index], ceil_div(dims[index], rows))
            return (1,) * index + (rows,) + dims[index + 1 :]
        trailing *= dims[index]
    return dims


def is_flat_chunking(shape: Sequence[int], chunk_shape: Sequence[int]) -> bool:
    """Whether every chunk of the grid holds consecutive elements of the row-major flattening
    (the chunk shape, clipped to the array, is flat-contiguous: docs/format.md §2.2).

    >>> is_flat_chunking((10, 4), (3, 4)), is_flat_chunking((10, 4), (1, 3))
    (True, True)
    >>> is_flat_chunking((10, 4), (2, 2))
    False
    """
    dims, chunk = tuple(shape), tuple(chunk_shape)
    if len(dims) != len(chunk):
        return False
    cut = 0
    while cut < len(dims) and chunk[cut] == 1:
        cut += 1
    return all(c >= d for c, d in zip(chunk[cut + 1 :], dims[cut + 1 :], strict=True))


def box_chunk_shape(
    shape: Sequence[int], itemsize: int, policy: ChunkPolicy
) -> tuple[int, ...] | None:
    """The box chunk of a matrix under ``policy`` (module docstring), or None where the
    matrix gets a flat-contiguous chunk (not 2-D, smaller than ``box_min_bytes``, fewer columns
    than ``tp_max``, or ``tp_max`` 1).

    >>> box_chunk_shape((4096, 11008), 4, ChunkPolicy())
    (8, 1376)
    >>> box_chunk_shape((256, 1024), 4, ChunkPolicy())
    (8, 128)
    >>> box_chunk_shape((512, 262144), 4, ChunkPolicy())
    (1, 16384)
    """
    dims = tuple(shape)
    if len(dims) != 2 or policy.tp_max <= 1 or dims[1] < policy.tp_max:
        return None
    rows, columns = dims
    if rows * columns * itemsize < policy.box_min_bytes:
        return None
    cols = ceil_div(columns, policy.tp_max)
    if cols * itemsize > policy.chunk_bytes:  # one slice's row is a chunk or more: row pieces
        parts = ceil_div(cols * itemsize, policy.chunk_bytes)
        return 1, ceil_div(cols, parts)
    row_bytes = cols * itemsize
    low = ceil_div(max(1, policy.chunk_bytes // BOX_MIN_FRACTION), row_bytes)
    high = max(low, policy.chunk_bytes // row_bytes)
    return _box_rows(rows, min(low, rows), min(high, rows), policy.tp_max, policy.dp_max), cols


#: Box chunk rows are the largest whose row pieces read at most this much over what they need.
BOX_ROW_TARGET = 1.1


def _row_pieces(rows: int, tp_max: int, dp_max: int) -> list[list[tuple[int, int]]]:
    """The row pieces of FSDP2 (``dp`` pieces of all rows) and FSDP2 + TP (``tp`` blocks, then
    ``dp`` pieces of each) at every power of two up to ``tp_max`` and ``dp_max``."""
    layouts = []
    tp = 1
    while tp <= tp_max:
        dp = 1
        while dp <= dp_max:
            pieces = []
            block = ceil_div(rows, tp)
            for first in range(0, rows, block):
                end = min(rows, first + block)
                step = ceil_div(end - first, dp)
                pieces += [(a, min(end, a + step)) for a in range(first, end, step)]
            layouts.append(pieces)
            dp *= 2
        tp *= 2
    return layouts


def _candidates(low: int, high: int) -> list[int]:
    """Row counts in ``[low, high]`` worth trying, largest first: every one in a short range,
    else ``2^k x m`` for odd ``m <= 7`` (they divide the row pieces of powers-of-two layouts)."""
    if high - low <= 16:
        return list(range(high, low - 1, -1))
    found = {high, low}
    for odd in (1, 3, 5, 7):
        value = odd
        while value <= high:
            if value >= low:
                found.add(value)
            value *= 2
    return sorted(found, reverse=True)


@functools.lru_cache(maxsize=256)
def _box_rows(rows: int, low: int, high: int, tp_max: int, dp_max: int) -> int:
    """The chunk rows in ``[low, high]``: the largest whose worst layout (mean over its pieces
    of fetched rows / needed rows) is within :data:`BOX_ROW_TARGET`, else the best one."""
    # layouts whose pieces are shorter than the smallest chunk cannot be helped: left out
    layouts = [
        pieces
        for pieces in _row_pieces(rows, tp_max, dp_max)
        if min(b - a for a, b in pieces) >= low
    ]
    if not layouts:
        return high

    def cost(size: int) -> float:
        worst = 0.0
        for pieces in layouts:
            total = sum(
                (min(rows, ceil_div(b, size) * size) - a // size * size) / (b - a)
                for a, b in pieces
            )
            worst = max(worst, total / len(pieces))
        return worst

    best, best_cost = high, cost(high)
    for size in _candidates(low, high):
        found = cost(size) if size != high else best_cost
        if found <= BOX_ROW_TARGET:
            return size
        if found < best_cost:
            best, best_cost = size, found
    return best


def shard_block(
    shape: Sequence[int], chunk_shape: Sequence[int], itemsize: int, shard_bytes: int
) -> tuple[int, ...]:
    """The shard shape, in chunks, for ``chunk_shape``: the largest flat-contiguous block of
    whole chunks of at most about ``shard_bytes`` (for box chunks: whole rows of chunks, at
    least one)."""
    dims, chunk = tuple(shape), tuple(chunk_shape)
    grid = tuple(ceil_div(d, c) for d, c in zip(dims, chunk, strict=True))
    chunk_elements = 1
    for dim in chunk:
        chunk_elements *= dim
    per_shard = max(1, shard_bytes // (itemsize * chunk_elements))
    if is_flat_chunking(dims, chunk):
        return flat_block_shape(grid, per_shard)
    across = 1
    for extent in grid[1:]:
        across *= extent
    rows = min(grid[0], max(1, per_shard // across))
    rows = ceil_div(grid[0], ceil_div(grid[0], rows))
    return (rows, *grid[1:])


def choose_chunking(shape: Sequence[int], itemsize: int, policy: ChunkPolicy) -> Chunking:
    """Chunk and shard shapes for an array of ``shape`` and ``itemsize`` under ``policy``.

    The shard is a flat-contiguous block of whole chunks, so every shard dimension is a
    multiple of the chunk dimension (it may overhang the array at the split dimension, and at
    the columns of box chunks). Memoized: a model repeats a few shapes over many arrays, and a
    live save asks again at every save.
    """
    return _choose_chunking(tuple(shape), itemsize, policy)


@functools.lru_cache(maxsize=4096)
def _choose_chunking(dims: tuple[int, ...], itemsize: int, policy: ChunkPolicy) -> Chunking:
    if not dims:
        return Chunking((), ())
    if any(dim == 0 for dim in dims):
        chunk = flat_block_shape(dims, max(1, policy.chunk_bytes // itemsize))
        return Chunking(chunk, chunk)
    chunk = box_chunk_shape(dims, itemsize, policy) or flat_block_shape(
        dims, max(1, policy.chunk_bytes // itemsize)
    )
    block = shard_block(dims, chunk, itemsize, policy.shard_bytes)
    return Chunking(chunk, tuple(b * c for b, c in zip(block, chunk, strict=True)))


def _flat(shape: Sequence[int], coords: Sequence[int]) -> int:
    index = 0
    for dim, coord in zip(shape, coords, strict=True):
        index = index * dim + coord
    return index


def _coords(shape: Sequence[int], index: int) -> list[int]:
    coords: list[int] = []
    for dim in reversed(shape):
        coords.append(index % dim)
        index //= dim
    coords.reverse()
    return coords


def _chunk_span(shape: Sequence[int], chunk_shape: Sequence[int], index: int) -> tuple[int, int]:
    """The flat range of the (flat-contiguous) chunk holding flat element ``index``."""
    corner = [c // k * k for c, k in zip(_coords(shape, index), chunk_shape, strict=True)]
    size = 1
    for k, dim, c in zip(chunk_shape, shape, corner, strict=True):
        size *= min(k, dim - c)
    start = _flat(shape, corner)
    return start, start + size


def chunk_aligned_range(
    shape: Sequence[int], chunk_shape: Sequence[int], start: int, stop: int
) -> tuple[int, int]:
    """The smallest flat range holding every chunk that holds an element of ``[start, stop)``.

    For flat-contiguous chunks reading the widened range costs the same bytes as the exact one
    (a chunk is the unit of reads) but maps to fewer boxes, often one. For box chunks it spans
    whole chunk rows; readers read the exact chunks instead
    (:func:`ucformat.layout.ranges.chunk_cover`).

    >>> chunk_aligned_range((10, 4), (3, 4), 5, 14)
    (0, 24)
    >>> chunk_aligned_range((4, 8), (2, 4), 9, 11)
    (0, 12)
    """
    if start >= stop or not shape:
        return start, stop
    if is_flat_chunking(shape, chunk_shape):
        return _chunk_span(shape, chunk_shape, start)[0], _chunk_span(shape, chunk_shape, stop - 1)[
            1
        ]
    low, high = stop, start
    for box in chunk_cover(shape, chunk_shape, [(start, stop)]):
        low = min(low, _flat(shape, [piece.start for piece in box]))
        high = max(high, _flat(shape, [piece.stop - 1 for piece in box]) + 1)
    return low, high


def _largest_divisor(value: int, limit: int) -> int:
    """The largest divisor of ``value`` (> 0) that is at most ``limit`` (at least 1)."""
    best = 1
    for candidate in range(1, math.isqrt(value) + 1):
        if value % candidate == 0:
            for d in (candidate, value // candidate):
                if best < d <= limit:
                    best = d
    return best


#: An aligned chunk is used only if it holds at least this fraction of the policy's chunk.
MIN_ALIGNED_FRACTION = 4


def aligned_chunking(
    shape: Sequence[int], itemsize: int, policy: ChunkPolicy, row_boundaries: Sequence[int]
) -> Chunking:
    """Chunk and shard shapes whose dim-0 boundaries include every row in ``row_boundaries``.

    With aligned shards no store shard straddles two holders, so each is written by the rank
    holding it, from its own memory (FSDP2 row shards, ZeRO-3 partitions:
    :func:`fragment_rows`). The chunk keeps the policy's shape (flat-contiguous or box:
    :func:`~ucformat.layout.chunking.choose_chunking`) with its dim-0 rows cut down to a
    divisor of the boundaries; if that leaves chunks smaller than a quarter of the policy's
    target, the policy's own chunking is returned (some shards then straddle owners).

    >>> aligned_chunking((1024, 1024), 4, ChunkPolicy(65536, 1 << 24), [512]).shard_shape
    (512, 1024)
    """
    return _aligned_chunking(tuple(shape), itemsize, policy, tuple(row_boundaries))


@functools.lru_cache(maxsize=4096)
def _aligned_chunking(
    shape: tuple[int, ...], itemsize: int, policy: ChunkPolicy, row_boundaries: tuple[int, ...]
) -> Chunking:
    default = choose_chunking(shape, itemsize, policy)
    inner = [b for b in row_boundaries if 0 < b < (shape[0] if shape else 0)]
    if not shape or not inner or math.prod(shape) == 0:
        return default
    step = math.gcd(*inner)
    chunk = list(default.chunk_shape)
    if chunk[0] > 1:  # a chunk spans several rows: make its rows divide the boundaries
        rows = _largest_divisor(step, chunk[0])
        if rows * MIN_ALIGNED_FRACTION < chunk[0]:
            return default
        chunk[0] = rows
    block = list(shard_block(shape, chunk, itemsize, policy.shard_bytes))
    if block[0] > 1:  # a shard spans several chunk rows: the same for shards
        block[0] = _largest_divisor(step // chunk[0], block[0])
    return Chunking(tuple(chunk), tuple(b * c for b, c in zip(block, chunk, strict=True)))


def fragment_rows(
    shape: Sequence[int], itemsize: int, policy: ChunkPolicy, starts: Sequence[int]
) -> list[int] | None:
    """The row boundaries of an array's source fragments (flat ``starts``), where shards can
    follow them: every start falls on a whole row and every piece between two boundaries holds
    at least one chunk target of bytes. None otherwise (shards then keep the policy's shape and
    may straddle fragments).

    >>> fragment_rows((1024, 256), 4, ChunkPolicy(), [0, 65536, 131072, 196608])
    [256, 512, 768]
    >>> fragment_rows((1024, 256), 4, ChunkPolicy(), [0, 65000]) is None  # not a whole row
    True
    >>> fragment_rows((768,), 4, ChunkPolicy(), [0, 192, 384, 576]) is None  # pieces too small
    True
    """
    dims = tuple(shape)
    if not dims or math.prod(dims) == 0:
        return None
    row = math.prod(dims[1:])
    cuts = sorted({start for start in starts if 0 < start < math.prod(dims)})
    if not cuts or any(start % row for start in cuts):
        return None
    edges = [0, *cuts, math.prod(dims)]
    if min(b - a for a, b in itertools.pairwise(edges)) * itemsize < policy.chunk_bytes:
        return None
    return [start // row for start in cuts]
