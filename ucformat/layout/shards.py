"""The byte layout of one uncompressed shard object: where each chunk's bytes go.

A shard written with the store's codec chain and no compression (docs/format.md §2.1) is

    chunk, crc32c, chunk, crc32c, ..., index, crc32c

where every chunk present is stored at its full chunk shape (edge chunks padded with the fill
value 0) followed by its 4-byte little-endian crc32c, and the index (``uint64`` little-endian,
``(offset, nbytes)`` per chunk of the shard's chunk grid in C order, ``2**64 - 1`` twice for an
absent chunk) is followed by its own crc32c. Chunks are stored in the compressed Morton order of
the shard's chunk grid, and exactly the chunks that intersect the array are present: what
zarr-python writes for a whole-shard region write, byte for byte.

With flat-contiguous chunks (§2.2) each chunk holds one run of consecutive elements of the
array, so a writer can assemble a shard straight from flat source ranges: :func:`shard_layout`
says where each run goes. Pure integer arithmetic: no zarr, no numpy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from ucformat.layout.grid import chunk_box
from ucformat.layout.partition import ceil_div

__all__ = ["CRC_BYTES", "ChunkSlot", "INDEX_ENTRY_BYTES", "ShardLayout", "morton_order",
           "shard_layout"]  # fmt: skip

CRC_BYTES = 4
INDEX_ENTRY_BYTES = 16
ABSENT = 2**64 - 1


@dataclass(frozen=True)
class ChunkSlot:
    """One chunk of a shard: its run of array elements and where its bytes go."""

    #: Coordinates in the shard's chunk grid.
    local: tuple[int, ...]
    #: First element of the run, in the array's row-major flattening.
    flat_start: int
    #: Elements in the run (the chunk's part inside the array).
    length: int
    #: Byte offset of the chunk's data in the shard object (its crc32c follows the data).
    offset: int


@dataclass(frozen=True)
class ShardLayout:
    """Every chunk of one shard in storage order, the chunk size and the index position."""

    chunks_per_shard: tuple[int, ...]
    #: Bytes of one stored chunk's data (full chunk shape), without its crc32c.
    chunk_nbytes: int
    slots: tuple[ChunkSlot, ...]
    #: Byte offset of the index; the object is ``index_offset + index_nbytes`` long.
    index_offset: int

    @property
    def index_nbytes(self) -> int:
        """Bytes of the index with its crc32c."""
        return INDEX_ENTRY_BYTES * prod(self.chunks_per_shard) + CRC_BYTES

    @property
    def nbytes(self) -> int:
        """Size of the shard object."""
        return self.index_offset + self.index_nbytes


def morton_order(grid: Sequence[int]) -> list[tuple[int, ...]]:
    """Every coordinate of ``grid`` in compressed Morton (Z) order, as zarr orders shard chunks.

    Bit ``b`` of every dimension that needs more than ``b`` bits is interleaved in dimension
    order, lowest bits first; dimensions of extent 1 take no bits.

    >>> morton_order((2, 2))
    [(0, 0), (1, 0), (0, 1), (1, 1)]
    >>> morton_order((3, 1))
    [(0, 0), (1, 0), (2, 0)]
    """
    bits = [(extent - 1).bit_length() for extent in grid]

    def code(coords: tuple[int, ...]) -> int:
        value = out = 0
        for bit in range(max(bits, default=0)):
            for dim, coord in enumerate(coords):
                if bit < bits[dim]:
                    value |= ((coord >> bit) & 1) << out
                    out += 1
        return value

    return sorted(itertools.product(*(range(extent) for extent in grid)), key=code)


def shard_layout(
    shape: Sequence[int],
    chunk_shape: Sequence[int],
    shard_shape: Sequence[int],
    itemsize: int,
    shard: Sequence[int],
) -> ShardLayout:
    """The layout of shard ``shard`` (coordinates in the shard grid) of an array.

    Raises:
        ValueError: the array is 0-d or empty, the shard is not a whole number of chunks, or a
            chunk is not flat-contiguous (its elements are not one run).

    >>> layout = shard_layout((10, 4), (3, 4), (6, 4), 4, (1,))
    Traceback (most recent call last):
    ...
    ValueError: shard coordinates (1,) do not match a 2-d array
    >>> layout = shard_layout((10, 4), (3, 4), (6, 4), 4, (1, 0))
    >>> [(s.local, s.flat_start, s.length, s.offset) for s in layout.slots]
    [((0, 0), 24, 12, 0), ((1, 0), 36, 4, 52)]
    >>> layout.chunk_nbytes, layout.index_offset, layout.nbytes
    (48, 104, 140)
    """
    dims, chunks, shards = tuple(shape), tuple(chunk_shape), tuple(shard_shape)
    if not dims or prod(dims) == 0:
        raise ValueError(f"no shard layout for an array of shape {dims}")
    if len(shard) != len(dims) or len(chunks) != len(dims) or len(shards) != len(dims):
        raise ValueError(f"shard coordinates {tuple(shard)} do not match a {len(dims)}-d array")
    if any(s % c for s, c in zip(shards, chunks, strict=True)):
        raise ValueError(f"shard shape {shards} is not a whole number of chunks {chunks}")
    per_shard = tuple(s // c for s, c in zip(shards, chunks, strict=True))
    grid = tuple(ceil_div(d, c) for d, c in zip(dims, chunks, strict=True))
    chunk_nbytes = prod(chunks) * itemsize
    slots: list[ChunkSlot] = []
    offset = 0
    for local in morton_order(per_shard):
        coords = tuple(s * p + c for s, p, c in zip(shard, per_shard, local, strict=True))
        if any(c >= g for c, g in zip(coords, grid, strict=True)):
            continue  # outside the array: zarr stores nothing for it
        box = chunk_box(dims, chunks, coords)
        first = last = 0
        for dim, piece in zip(dims, box, strict=True):
            first = first * dim + piece.start
            last = last * dim + piece.stop - 1
        length = prod(piece.stop - piece.start for piece in box)
        if last + 1 - first != length:
            raise ValueError(f"chunk {coords} of chunk shape {chunks} in {dims} is not one run")
        slots.append(ChunkSlot(local, first, length, offset))
        offset += chunk_nbytes + CRC_BYTES
    return ShardLayout(per_shard, chunk_nbytes, tuple(slots), offset)
