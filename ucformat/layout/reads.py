"""What a partial read costs: the chunks and shard indexes a flat range makes a reader fetch.

Pure arithmetic on the chunking of an array, used to predict read amplification (the scale
table in docs/benchmarks.md) and checked against real byte counts in the tests.

Costs follow the store format (docs/format.md §2): every inner chunk is stored at its full
chunk shape (edge chunks padded) plus a 4-byte crc32c; each shard ends with an index of 16 bytes
per chunk plus a 4-byte crc32c, which a reader fetches once per shard it touches (readers cache
indexes). Compression is ignored (ucformat's default is none).

Requests follow the reader (:mod:`ucformat.store.direct.shard_read`): one suffix request per
shard index (once per reader), and per range one range request per shard it touches (the
range's chunks of one shard are stored back to back, so they are one run); a 0-d array is one
whole-object request and has no index. With chunks that are not flat-contiguous (box chunks,
docs/format.md §2.2) a range's chunks of one shard may be several runs in storage: per range and
shard, one request per run of its chunks stored back to back, exactly as the reader groups them;
``together`` counts the requests of one read of all the ranges at once
(:meth:`~ucformat.read.checkpoint.UniversalCheckpoint.read_runs` on such arrays).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod

from ucformat.layout.chunking import chunk_aligned_range, is_flat_chunking
from ucformat.layout.partition import ceil_div
from ucformat.layout.placements import merge_runs
from ucformat.layout.ranges import Rect, box_rect, flat_range_to_boxes, union_cover
from ucformat.layout.shards import morton_order

__all__ = [
    "ReadCost",
    "chunk_ids",
    "chunk_rects_read_cost",
    "range_read_cost",
    "runs_read_cost",
]

CRC_BYTES = 4
INDEX_ENTRY_BYTES = 16


@dataclass(frozen=True)
class ReadCost:
    """Bytes a reader fetches for some flat ranges of one array."""

    data_bytes: int
    index_bytes: int
    chunks: int
    shards: int
    #: Range requests for chunk data: per range, one per shard it touches.
    data_requests: int = 0
    #: Suffix requests for shard indexes: one per shard touched (0 for a 0-d array).
    index_requests: int = 0

    @property
    def total(self) -> int:
        """All bytes fetched."""
        return self.data_bytes + self.index_bytes

    @property
    def requests(self) -> int:
        """All requests made."""
        return self.data_requests + self.index_requests

    def __add__(self, other: ReadCost) -> ReadCost:
        return ReadCost(
            self.data_bytes + other.data_bytes,
            self.index_bytes + other.index_bytes,
            self.chunks + other.chunks,
            self.shards + other.shards,
            self.data_requests + other.data_requests,
            self.index_requests + other.index_requests,
        )


def _grid(shape: Sequence[int], block: Sequence[int]) -> list[int]:
    return [ceil_div(d, b) for d, b in zip(shape, block, strict=True)]


def _block_id(shape: Sequence[int], block: Sequence[int], flat_index: int) -> int:
    """Row-major id, in the block grid, of the block holding flat element ``flat_index``."""
    coords: list[int] = []
    rest = flat_index
    for dim in reversed(shape):
        coords.append(rest % dim)
        rest //= dim
    coords.reverse()
    block_id = 0
    for coord, size, extent in zip(coords, block, _grid(shape, block), strict=True):
        block_id = block_id * extent + coord // size
    return block_id


def chunk_ids(shape: Sequence[int], chunk_shape: Sequence[int], start: int, stop: int) -> range:
    """Ids (row-major in the chunk grid) of the chunks holding flat elements ``[start, stop)``.

    Chunks must be flat-contiguous (these are then consecutive ids).

    Raises:
        ValueError: the chunks are not flat-contiguous.
    """
    if start >= stop:
        return range(0)
    if not shape:
        return range(1)
    if not is_flat_chunking(shape, chunk_shape):
        raise ValueError(f"chunks {tuple(chunk_shape)} of {tuple(shape)} are not flat-contiguous")
    low, high = chunk_aligned_range(shape, chunk_shape, start, stop)
    return range(_block_id(shape, chunk_shape, low), _block_id(shape, chunk_shape, high - 1) + 1)


def range_read_cost(
    shape: Sequence[int],
    chunk_shape: Sequence[int],
    shard_shape: Sequence[int],
    itemsize: int,
    ranges: Iterable[tuple[int, int]],
    *,
    together: bool = False,
) -> ReadCost:
    """Bytes fetched to read ``ranges`` of one array (each chunk and index fetched once).

    Requests count one read per range, or (``together``) one read of all of them.
    """
    if shape and not is_flat_chunking(shape, chunk_shape):
        return _box_read_cost(shape, chunk_shape, shard_shape, itemsize, list(ranges), together)
    chunks: set[int] = set()
    shards: set[int] = set()
    data_requests = 0
    for start, stop in ranges:
        ids = chunk_ids(shape, chunk_shape, start, stop)
        chunks.update(ids)
        if shape and ids:
            first = _chunk_to_shard(shape, chunk_shape, shard_shape, ids[0])
            last = _chunk_to_shard(shape, chunk_shape, shard_shape, ids[-1])
            shards.update(range(first, last + 1))
            data_requests += last - first + 1
        elif ids:
            shards.add(0)
            data_requests += 1
    chunk_bytes = prod(chunk_shape) * itemsize + CRC_BYTES
    per_shard = prod(s // c for s, c in zip(shard_shape, chunk_shape, strict=True)) if shape else 0
    index_bytes = (INDEX_ENTRY_BYTES * per_shard + CRC_BYTES) if shape else 0
    return ReadCost(
        data_bytes=len(chunks) * chunk_bytes,
        index_bytes=len(shards) * index_bytes,
        chunks=len(chunks),
        shards=len(shards),
        data_requests=data_requests,
        index_requests=len(shards) if shape else 0,
    )


def _chunk_to_shard(
    shape: Sequence[int], chunk_shape: Sequence[int], shard_shape: Sequence[int], chunk_id: int
) -> int:
    grid = _grid(shape, chunk_shape)
    coords: list[int] = []
    rest = chunk_id
    for extent in reversed(grid):
        coords.append(rest % extent)
        rest //= extent
    coords.reverse()
    per_shard = [s // c for s, c in zip(shard_shape, chunk_shape, strict=True)]
    shard_grid = _grid(grid, per_shard)
    shard_id = 0
    for coord, per, extent in zip(coords, per_shard, shard_grid, strict=True):
        shard_id = shard_id * extent + coord // per
    return shard_id


def runs_read_cost(
    shape: Sequence[int],
    chunk_shape: Sequence[int],
    shard_shape: Sequence[int],
    itemsize: int,
    runs: Iterable[tuple[int, int]],
) -> ReadCost:
    """What :meth:`~ucformat.read.checkpoint.UniversalCheckpoint.read_runs` fetches for the flat
    ``runs`` of one local shard: with flat-contiguous chunks the runs' chunk-widened spans that
    touch are merged and each read once; with box chunks all runs are one read."""
    spans = [(start, stop) for start, stop in runs if start < stop]
    if shape and not is_flat_chunking(shape, chunk_shape):
        return range_read_cost(shape, chunk_shape, shard_shape, itemsize, spans, together=True)
    widened = [chunk_aligned_range(shape, chunk_shape, start, stop) for start, stop in spans]
    ranges = []
    for _, _, members in merge_runs(widened):
        ranges.append((min(spans[i][0] for i in members), max(spans[i][1] for i in members)))
    return range_read_cost(shape, chunk_shape, shard_shape, itemsize, ranges)


def _area(rect: Rect) -> int:
    return prod(hi - lo for lo, hi in rect)


def _clip(rect: Rect, other: Rect) -> Rect | None:
    out = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(rect, other, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _box_read_cost(
    shape: Sequence[int],
    chunk_shape: Sequence[int],
    shard_shape: Sequence[int],
    itemsize: int,
    ranges: list[tuple[int, int]],
    together: bool,
) -> ReadCost:
    """:func:`range_read_cost` for any chunk shape (exact: chunks counted as grid rects)."""
    calls: list[list[Rect]] = []
    for start, stop in ranges:
        rects = [box_rect(box, chunk_shape) for box in flat_range_to_boxes(shape, start, stop)]
        if together and calls:
            calls[0] += rects
        elif rects:
            calls.append(rects)
    return chunk_rects_read_cost(shape, chunk_shape, shard_shape, itemsize, calls)


def chunk_rects_read_cost(
    shape: Sequence[int],
    chunk_shape: Sequence[int],
    shard_shape: Sequence[int],
    itemsize: int,
    calls: Sequence[Sequence[Rect]],
) -> ReadCost:
    """What reads of whole chunks fetch, each read (an item of ``calls``) given as rects of
    the chunk grid (per dimension ``(lo, hi)`` of chunk coordinates): every chunk and shard
    index once, and per read and shard one request per run of its chunks stored back to back
    (zarr's Morton order in the shard)."""
    grid = _grid(shape, chunk_shape)
    per_shard = [s // c for s, c in zip(shard_shape, chunk_shape, strict=True)]
    covers = [union_cover(rects) for rects in calls if rects]
    chunks = sum(_area(rect) for rect in union_cover(r for cover in covers for r in cover))
    shards: set[tuple[int, ...]] = set()
    data_requests = 0
    for cover in covers:
        touched: set[tuple[int, ...]] = set()
        for rect in cover:
            shard_rect = tuple(
                (lo // per, (hi - 1) // per + 1)
                for (lo, hi), per in zip(rect, per_shard, strict=True)
            )
            touched.update(itertools.product(*(range(lo, hi) for lo, hi in shard_rect)))
        for coords in touched:
            data_requests += _shard_runs(coords, per_shard, grid, cover)
        shards |= touched
    chunk_bytes = prod(chunk_shape) * itemsize + CRC_BYTES
    index_bytes = INDEX_ENTRY_BYTES * prod(per_shard) + CRC_BYTES
    return ReadCost(
        data_bytes=chunks * chunk_bytes,
        index_bytes=len(shards) * index_bytes,
        chunks=chunks,
        shards=len(shards),
        data_requests=data_requests,
        index_requests=len(shards),
    )


def _shard_runs(
    coords: tuple[int, ...], per_shard: Sequence[int], grid: Sequence[int], cover: list[Rect]
) -> int:
    """Runs of chunks stored back to back among the chunks of ``cover`` in one shard (in
    zarr's Morton order of the shard's chunks, skipping those outside the array)."""
    region = tuple(
        (c * per, min((c + 1) * per, extent))
        for c, per, extent in zip(coords, per_shard, grid, strict=True)
    )
    parts = [part for rect in cover if (part := _clip(rect, region)) is not None]
    if sum(_area(part) for part in parts) == _area(region):
        return 1  # every chunk present in the shard: stored back to back
    index = _morton_index(tuple(per_shard))
    wanted = sorted(
        index[tuple(c - lo for c, (lo, _) in zip(cell, region, strict=True))]
        for part in parts
        for cell in itertools.product(*(range(lo, hi) for lo, hi in part))
    )
    present = _present_before(tuple(per_shard), tuple(hi - lo for lo, hi in region))
    # a new run starts where a present chunk lies between two wanted ones
    return sum(1 for a, b in itertools.pairwise(wanted) if present[b] - present[a + 1]) + 1


@functools.lru_cache(maxsize=64)
def _morton_index(per_shard: tuple[int, ...]) -> dict[tuple[int, ...], int]:
    """Each chunk of a shard of ``per_shard`` chunks by its place in zarr's Morton order."""
    return {local: place for place, local in enumerate(morton_order(per_shard))}


@functools.lru_cache(maxsize=256)
def _present_before(per_shard: tuple[int, ...], extent: tuple[int, ...]) -> list[int]:
    """``[i]``: how many of the first ``i`` chunks in Morton order lie inside a shard clipped
    to ``extent`` chunks per dimension (the stored ones)."""
    counts = [0]
    for local in morton_order(per_shard):
        counts.append(counts[-1] + all(c < e for c, e in zip(local, extent, strict=True)))
    return counts
