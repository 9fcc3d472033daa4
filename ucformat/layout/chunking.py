"""Chunk and shard shapes: a pure function of an array's shape, itemsize and byte targets.

Every chunk and every shard is a *flat-contiguous block*: ``(1, ..., 1, k, d_{j+1}, ..., d_n)``,
i.e. a run of whole trailing sub-arrays, so a chunk holds consecutive elements of the row-major
flattening (the trailing dimension may be split into equal parts when one row alone exceeds the
target). Consequences:

* a flat range ``[a, b)`` of a parameter (what a ZeRO rank owns) touches only the chunks that hold
  its elements, plus at most one partial chunk at each end;
* a shard is a flat range too, so the converter fills one shard from the source fragments in
  memory and writes it once, never read-modify-write.

The targets are bytes of uncompressed data: ``chunk_bytes`` sets the read granularity (and thus
over-read at partition boundaries), ``shard_bytes`` the number of storage objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ucformat.layout.partition import ceil_div

__all__ = ["ChunkPolicy", "Chunking", "choose_chunking", "chunk_aligned_range", "flat_block_shape"]


@dataclass(frozen=True)
class ChunkPolicy:
    """Byte targets for inner chunks and shards (uncompressed).

    The defaults come from the simulated scale table in docs/benchmarks.md (read amplification
    of large-world-size loads, by chunk and shard size). A shard is also the converter's unit
    of memory: it holds about ``workers x shard_bytes``.
    """

    chunk_bytes: int = 64 * 1024
    shard_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.shard_bytes < self.chunk_bytes:
            raise ValueError(
                f"need 1 <= chunk_bytes <= shard_bytes, got {self.chunk_bytes}, {self.shard_bytes}"
            )


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


def choose_chunking(shape: Sequence[int], itemsize: int, policy: ChunkPolicy) -> Chunking:
    """Chunk and shard shapes for an array of ``shape`` and ``itemsize`` under ``policy``.

    The shard is a flat-contiguous block of whole chunks, so every shard dimension is a
    multiple of the chunk dimension (it may overhang the array at the split dimension).
    """
    dims = tuple(shape)
    if not dims:
        return Chunking((), ())
    chunk = flat_block_shape(dims, max(1, policy.chunk_bytes // itemsize))
    if any(dim == 0 for dim in dims):
        return Chunking(chunk, chunk)
    grid = tuple(ceil_div(d, c) for d, c in zip(dims, chunk, strict=True))
    chunk_elements = 1
    for dim in chunk:
        chunk_elements *= dim
    chunks_per_shard = max(1, policy.shard_bytes // (itemsize * chunk_elements))
    block = flat_block_shape(grid, chunks_per_shard)
    return Chunking(chunk, tuple(b * c for b, c in zip(block, chunk, strict=True)))


def _chunk_span(shape: Sequence[int], chunk_shape: Sequence[int], index: int) -> tuple[int, int]:
    """The flat range of the (flat-contiguous) chunk holding flat element ``index``."""
    coords: list[int] = []
    rest = index
    for dim in reversed(shape):
        coords.append(rest % dim)
        rest //= dim
    coords.reverse()
    corner = [c // k * k for c, k in zip(coords, chunk_shape, strict=True)]
    start = 0
    for dim, c in zip(shape, corner, strict=True):
        start = start * dim + c
    size = 1
    for k, dim, c in zip(chunk_shape, shape, corner, strict=True):
        size *= min(k, dim - c)
    return start, start + size


def chunk_aligned_range(
    shape: Sequence[int], chunk_shape: Sequence[int], start: int, stop: int
) -> tuple[int, int]:
    """Widen the flat range ``[start, stop)`` to whole chunks (chunks are flat-contiguous).

    Reading the widened range costs the same bytes as the exact one (a chunk is the unit of
    reads) but maps to fewer boxes, often one.

    >>> chunk_aligned_range((10, 4), (3, 4), 5, 14)
    (0, 24)
    """
    if start >= stop or not shape:
        return start, stop
    return _chunk_span(shape, chunk_shape, start)[0], _chunk_span(shape, chunk_shape, stop - 1)[1]
