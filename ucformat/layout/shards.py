"""The byte layout of one uncompressed shard object: where each chunk's bytes go.

A shard written with the store's codec chain and no compression (docs/format.md §2.1) is

    chunk, crc32c, chunk, crc32c, ..., index, crc32c

where every chunk present is stored at its full chunk shape (edge chunks padded with the fill
value 0) followed by its 4-byte little-endian crc32c, and the index (``uint64`` little-endian,
``(offset, nbytes)`` per chunk of the shard's chunk grid in C order, ``2**64 - 1`` twice for an
absent chunk) is followed by its own crc32c. Chunks are stored in the compressed Morton order of
the shard's chunk grid, and exactly the chunks that intersect the array are present: what
zarr-python writes for a whole-shard region write, byte for byte.

Each chunk holds one run of consecutive elements of the array (flat-contiguous chunks, §2.2)
or, for any other chunk shape (box chunks), several: :func:`shard_layout` says where each run
of each chunk goes, so a writer can assemble a shard straight from flat source ranges. Pure
integer arithmetic: no zarr, no numpy.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from ucformat.layout.chunking import is_flat_chunking
from ucformat.layout.partition import ceil_div

__all__ = ["ABSENT", "CRC_BYTES", "ChunkSlot", "INDEX_ENTRY_BYTES", "ShardLayout", "box_runs",
           "morton_order", "shard_layout", "shards_in_range"]  # fmt: skip

CRC_BYTES = 4
INDEX_ENTRY_BYTES = 16
ABSENT = 2**64 - 1


@dataclass(frozen=True)
class ChunkSlot:
    """One chunk of a shard: its run of array elements and where its bytes go."""

    #: Coordinates in the shard's chunk grid.
    local: tuple[int, ...]
    #: First element of the chunk, in the array's row-major flattening.
    flat_start: int
    #: Elements of the chunk inside the array.
    length: int
    #: Byte offset of the chunk's data in the shard object (its crc32c follows the data).
    offset: int
    #: The chunk's part inside the array (global element coordinates).
    box: tuple[slice, ...] = ()
    #: Whether the chunk is one run of the array stored from its first element (the chunks
    #: are flat-contiguous); then ``runs`` is that run, else empty (:func:`box_runs` gives them).
    contiguous: bool = True

    @property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """The run of a flat-contiguous chunk ``((flat start, 0, length),)``; else empty."""
        return ((self.flat_start, 0, self.length),) if self.contiguous else ()


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


@functools.lru_cache(maxsize=64)
def _morton_order(grid: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    bits = [(extent - 1).bit_length() for extent in grid]

    def code(coords: tuple[int, ...]) -> int:
        value = out = 0
        for bit in range(max(bits, default=0)):
            for dim, coord in enumerate(coords):
                if bit < bits[dim]:
                    value |= ((coord >> bit) & 1) << out
                    out += 1
        return value

    return tuple(sorted(itertools.product(*(range(extent) for extent in grid)), key=code))


def morton_order(grid: Sequence[int]) -> list[tuple[int, ...]]:
    """Every coordinate of ``grid`` in compressed Morton (Z) order, as zarr orders shard chunks.

    Bit ``b`` of every dimension that needs more than ``b`` bits is interleaved in dimension
    order, lowest bits first; dimensions of extent 1 take no bits.

    >>> morton_order((2, 2))
    [(0, 0), (1, 0), (0, 1), (1, 1)]
    >>> morton_order((3, 1))
    [(0, 0), (1, 0), (2, 0)]
    """
    return list(_morton_order(tuple(grid)))


def shard_layout(
    shape: Sequence[int],
    chunk_shape: Sequence[int],
    shard_shape: Sequence[int],
    itemsize: int,
    shard: Sequence[int],
) -> ShardLayout:
    """The layout of shard ``shard`` (coordinates in the shard grid) of an array.

    Raises:
        ValueError: the array is 0-d or empty, or the shard is not a whole number of chunks.

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
    return _shard_layout(
        tuple(shape), tuple(chunk_shape), tuple(shard_shape), itemsize, tuple(shard)
    )


@functools.lru_cache(maxsize=64)  # a reader asks for the same shard once per state
def _shard_layout(
    dims: tuple[int, ...],
    chunks: tuple[int, ...],
    shards: tuple[int, ...],
    itemsize: int,
    shard: tuple[int, ...],
) -> ShardLayout:
    if not dims or prod(dims) == 0:
        raise ValueError(f"no shard layout for an array of shape {dims}")
    if len(shard) != len(dims) or len(chunks) != len(dims) or len(shards) != len(dims):
        raise ValueError(f"shard coordinates {tuple(shard)} do not match a {len(dims)}-d array")
    if any(s % c for s, c in zip(shards, chunks, strict=True)):
        raise ValueError(f"shard shape {shards} is not a whole number of chunks {chunks}")
    per_shard = tuple(s // c for s, c in zip(shards, chunks, strict=True))
    grid = tuple(ceil_div(d, c) for d, c in zip(dims, chunks, strict=True))
    chunk_nbytes = prod(chunks) * itemsize
    flat = is_flat_chunking(dims, chunks)
    corner = [s * p for s, p in zip(shard, per_shard, strict=True)]
    slots: list[ChunkSlot] = []
    offset = 0
    for local in morton_order(per_shard):
        box = []
        first, length = 0, 1
        for base, c, grid_extent, size, dim in zip(corner, local, grid, chunks, dims, strict=True):
            coord = base + c
            if coord >= grid_extent:
                break  # outside the array: zarr stores nothing for it
            low = coord * size
            high = min(low + size, dim)
            box.append(slice(low, high))
            first = first * dim + low
            length *= high - low
        else:
            slots.append(ChunkSlot(local, first, length, offset, tuple(box), flat))
            offset += chunk_nbytes + CRC_BYTES
    return ShardLayout(per_shard, chunk_nbytes, tuple(slots), offset)


def box_runs(
    shape: Sequence[int], chunk_shape: Sequence[int], box: tuple[slice, ...]
) -> tuple[tuple[int, int, int], ...]:
    """The runs of consecutive array elements of a chunk's ``box`` (its part inside the array,
    the chunk's corner at ``box``'s start): ``(flat start, position in the stored chunk,
    length)`` in the chunk's row-major order. Trailing dimensions that the box, the array and
    the chunk span alike merge into each run.

    >>> box_runs((4, 8), (2, 4), (slice(2, 4), slice(4, 8)))
    ((20, 0, 4), (28, 4, 4))
    >>> box_runs((10, 4), (3, 4), (slice(9, 10), slice(0, 4)))
    ((36, 0, 4),)
    """
    dims, chunk = tuple(shape), tuple(chunk_shape)
    sizes = [piece.stop - piece.start for piece in box]
    cut = len(dims) - 1
    while cut > 0 and sizes[cut] == dims[cut] == chunk[cut]:
        cut -= 1
    length = prod(sizes[cut:])
    runs = []
    for lead in itertools.product(*(range(p.start, p.stop) for p in box[:cut])):
        coords = (*lead, *(p.start for p in box[cut:]))
        flat = position = 0
        for index, (dim, size, coord) in enumerate(zip(dims, chunk, coords, strict=True)):
            flat = flat * dim + coord
            position = position * size + coord - box[index].start
        runs.append((flat, position, length))
    return tuple(runs)


def shards_in_range(
    shape: Sequence[int], shard_shape: Sequence[int], start: int, stop: int
) -> list[tuple[int, ...]]:
    """Coordinates of the shards holding flat elements ``[start, stop)``, in flat order.

    Shards are flat-contiguous blocks (docs/format.md §2.2), so they are the shards from the
    one holding ``start`` to the one holding ``stop - 1`` in row-major shard-grid order.

    >>> shards_in_range((10, 4), (6, 4), 20, 30)
    [(0, 0), (1, 0)]
    """
    if start >= stop:
        return []
    dims, blocks = tuple(shape), tuple(shard_shape)
    grid = [ceil_div(d, b) for d, b in zip(dims, blocks, strict=True)]

    def shard_id(index: int) -> int:
        coords = []
        for dim in reversed(dims):
            coords.append(index % dim)
            index //= dim
        value = 0
        for coord, block, extent in zip(reversed(coords), blocks, grid, strict=True):
            value = value * extent + coord // block
        return value

    out = []
    for value in range(shard_id(start), shard_id(stop - 1) + 1):
        coords = []
        for extent in reversed(grid):
            coords.append(value % extent)
            value //= extent
        out.append(tuple(reversed(coords)))
    return out
