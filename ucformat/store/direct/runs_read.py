"""Read flat runs of an uncompressed sharded array straight from its shard objects, any chunk
shape.

The entry points of the direct read path: :func:`read_runs` fills a buffer with flat runs
``[start, stop)`` of an array (each at its own position of the buffer), :func:`check_runs` checks
in place every chunk holding them. Arrays with flat-contiguous chunks go to
:mod:`ucformat.store.direct.shard_read` one run at a time (each chunk one run of the array,
``preadv`` straight into place). Arrays with box chunks (docs/format.md §2.2) are read here:

* each run becomes at most ``2 * ndim - 1`` boxes of the array
  (:func:`~ucformat.layout.ranges.flat_range_to_boxes`); consecutive one-row boxes of a column
  block (a ``Shard(1)`` local shard, one run per row) merge into one box;
* per shard touched: its index (a suffix read, cached per reader, crc32c checked), the chunks
  that hold part of a box, grouped into runs stored back to back, each one request;
* every chunk's crc32c is checked, then its part of each box is copied into place.

All runs are one read: a chunk shared by several runs is fetched once. The bytes and requests
are those :func:`ucformat.layout.reads.range_read_cost` predicts (``together=True``). Outcomes
as in :mod:`~ucformat.store.direct.shard_read` (``NOT_APPLICABLE``: the caller reads through
zarr; ``CORRUPT``: never returned as values).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import crc32c
import numpy as np
from zarr.abc.store import Store

from ucformat.format.dtypes import itemsize
from ucformat.format.stacks import StoredArray
from ucformat.layout.chunking import is_flat_chunking
from ucformat.layout.ranges import Box, box_rect, flat_range_to_boxes, intersect_boxes
from ucformat.layout.shards import CRC_BYTES, ChunkSlot, ShardLayout, shard_layout
from ucformat.store.direct.objects import fetch_bytes
from ucformat.store.direct.shard_read import (
    NOT_APPLICABLE,
    OK,
    DirectRead,
    Outcome,
    ShardKey,
    _index,
    back_to_back,
    check_flat_range,
    check_in_place,
    index_entry_problem,
    read_flat_range,
)

__all__ = ["FlatRun", "check_runs", "read_runs"]

#: ``(start, stop, at)``: flat elements ``[start, stop)`` of the array go to ``out[at:]``.
FlatRun = tuple[int, int, int]


def read_runs(
    store: Store, ref: StoredArray, shard_key: ShardKey, runs: Sequence[FlatRun], out: np.ndarray
) -> DirectRead:
    """Fill ``out`` (1-D, contiguous, storage dtype) with the flat ``runs`` of ``ref``.

    ``out`` holds the values only if the result is ``OK``.
    """
    runs = [run for run in runs if run[0] < run[1]]
    if not runs:
        return OK
    item = itemsize(ref.dtype)
    if out.ndim != 1 or not out.flags.c_contiguous or out.itemsize != item:
        return NOT_APPLICABLE
    if any(at < 0 or at + stop - start > out.size for start, stop, at in runs):
        return NOT_APPLICABLE
    if not ref.shape or is_flat_chunking(ref.shape, ref.chunk_shape):
        for start, stop, at in runs:
            result = read_flat_range(
                store, ref, shard_key, start, stop, out[at : at + stop - start]
            )
            if not result.ok:
                return result
        return OK
    if ref.compressor != "none":
        return NOT_APPLICABLE
    target = out.view(np.uint8).reshape(-1, item)
    pieces = _pieces(ref.shape, runs, target, item)
    placed = 0
    for shard in _shards(store, ref, shard_key, pieces):
        if isinstance(shard, DirectRead):
            return shard
        for chunks in shard.runs:
            done = _read_run(store, shard, chunks, pieces, ref.chunk_shape, item)
            if isinstance(done, DirectRead):
                return done
            placed += done
    return OK if placed == sum(stop - start for start, stop, _ in runs) else NOT_APPLICABLE


def check_runs(
    store: Store, ref: StoredArray, shard_key: ShardKey, runs: Sequence[tuple[int, int]]
) -> DirectRead:
    """Whether every chunk holding the flat ``runs`` is present and passes its crc32c, checked
    in place through a read-only map of each (local) shard file; nothing is copied or counted.
    ``NOT_APPLICABLE`` where :func:`read_runs` would not read directly, or for a store that is
    not a local directory."""
    spans = [(start, stop) for start, stop in runs if start < stop]
    if not ref.shape or is_flat_chunking(ref.shape, ref.chunk_shape):
        for start, stop in spans:
            result = check_flat_range(store, ref, shard_key, start, stop)
            if not result.ok:
                return result
        return OK
    if ref.compressor != "none":
        return NOT_APPLICABLE
    item = itemsize(ref.dtype)
    flat = [(start, stop, 0) for start, stop in spans]
    pieces = _pieces(ref.shape, flat, None, item)
    return check_in_place(store, _shards(store, ref, shard_key, pieces))


@dataclass
class _Piece:
    """A box of the array whose elements go, in its row-major order, to ``view``."""

    box: Box
    at: int
    size: int
    view: np.ndarray | None = None


def _stacks(first: Box, second: Box) -> bool:
    """Whether ``second`` continues ``first`` down dim -2 (so that the two, in row-major
    order one after the other, are one box in row-major order)."""
    if len(first) < 2:
        return False
    if any(a != b or a.stop - a.start != 1 for a, b in zip(first[:-2], second[:-2], strict=True)):
        return False
    return first[-1] == second[-1] and first[-2].stop == second[-2].start


def _pieces(
    shape: Sequence[int], runs: Sequence[FlatRun], target: np.ndarray | None, item: int
) -> list[_Piece]:
    pieces: list[_Piece] = []
    for start, stop, at in runs:
        for box in flat_range_to_boxes(shape, start, stop):
            size = math.prod(p.stop - p.start for p in box)
            last = pieces[-1] if pieces else None
            if last is not None and last.at + last.size == at and _stacks(last.box, box):
                merged = (*box[:-2], slice(last.box[-2].start, box[-2].stop), box[-1])
                pieces[-1] = _Piece(merged, last.at, last.size + size)
            else:
                pieces.append(_Piece(box, at, size))
            at += size
    if target is not None:
        for piece in pieces:
            sizes = [p.stop - p.start for p in piece.box]
            piece.view = target[piece.at : piece.at + piece.size].reshape(*sizes, item)
    return pieces


#: Per wanted chunk: its offset in the shard object, its slot, the pieces it holds part of.
_Chunks = list[tuple[int, ChunkSlot, list[int]]]


@dataclass(frozen=True)
class _Shard:
    key: str
    coords: tuple[int, ...]
    layout: ShardLayout
    runs: list[_Chunks]
    #: The array's shape.
    layout_shape: tuple[int, ...] = ()

    def chunk(self, slot: ChunkSlot) -> str:
        """``chunk (3, 0) (elements [48, 64))``, as the flat path describes a chunk."""
        per_shard = self.layout.chunks_per_shard
        coords = tuple(
            s * n + c for s, n, c in zip(self.coords, per_shard, slot.local, strict=True)
        )
        where = "(" + ", ".join(map(str, coords)) + ")"
        last = 0
        for dim, piece in zip(self.layout_shape, slot.box, strict=True):
            last = last * dim + piece.stop - 1
        return f"chunk {where} (elements [{slot.flat_start}, {last + 1}))"


def _corrupt(problem: str) -> DirectRead:
    return DirectRead(Outcome.CORRUPT, problem)


@functools.lru_cache(maxsize=64)
def _layout(
    dims: tuple[int, ...],
    chunks: tuple[int, ...],
    shards: tuple[int, ...],
    item: int,
    coords: tuple[int, ...],
) -> tuple[ShardLayout, dict[tuple[int, ...], ChunkSlot]]:
    layout = shard_layout(dims, chunks, shards, item, coords)
    return layout, {slot.local: slot for slot in layout.slots}


def _shards(
    store: Store, ref: StoredArray, shard_key: ShardKey, pieces: Sequence[_Piece]
) -> Iterator[_Shard | DirectRead]:
    """Each shard holding part of a piece, in grid order, with its wanted chunks in runs
    stored back to back; a last ``NOT_APPLICABLE`` or ``CORRUPT`` where an index does not
    allow a direct read."""
    item = itemsize(ref.dtype)
    by_shard: dict[tuple[int, ...], list[int]] = {}
    for number, piece in enumerate(pieces):
        rect = box_rect(piece.box, ref.shard_shape)
        for coords in itertools.product(*(range(lo, hi) for lo, hi in rect)):
            by_shard.setdefault(coords, []).append(number)
    for coords in sorted(by_shard):
        try:
            layout, slots = _layout(
                tuple(ref.shape), tuple(ref.chunk_shape), tuple(ref.shard_shape), item, coords
            )
        except ValueError:
            yield NOT_APPLICABLE
            return
        per_shard = layout.chunks_per_shard
        region = tuple(
            slice(c * s, min((c + 1) * s, d))
            for c, s, d in zip(coords, ref.shard_shape, ref.shape, strict=True)
        )
        wanted: dict[tuple[int, ...], list[int]] = {}
        for number in by_shard[coords]:
            part = intersect_boxes(pieces[number].box, region)
            if part is None:
                continue
            rect = box_rect(part, ref.chunk_shape)
            ranges = [
                range(lo - c * n, hi - c * n)
                for (lo, hi), c, n in zip(rect, coords, per_shard, strict=True)
            ]
            for local in itertools.product(*ranges):
                wanted.setdefault(local, []).append(number)
        if not wanted:
            continue
        key = shard_key(coords)
        entries = _index(store, key, per_shard, layout.index_nbytes)
        if isinstance(entries, DirectRead):
            yield entries
            return
        shard = _Shard(key, coords, layout, [], tuple(ref.shape))
        stored = layout.chunk_nbytes + CRC_BYTES
        data_end = math.prod(per_shard) * stored + layout.index_nbytes
        found: _Chunks = []
        for local, numbers in wanted.items():
            slot = slots[local]
            offset, nbytes = (int(v) for v in entries[local])
            problem = index_entry_problem(shard, slot, offset, nbytes, data_end)
            if problem is not None:
                yield _corrupt(problem)
                return
            found.append((offset, slot, numbers))
        shard.runs.extend(back_to_back(found, stored))
        yield shard


def _crc_ok(chunk: memoryview | np.ndarray, checksum: memoryview | np.ndarray) -> bool:
    data = chunk if isinstance(chunk, memoryview) else chunk.data
    return bool(crc32c.crc32c(data) == int.from_bytes(bytes(checksum), "little"))


def _read_run(
    store: Store,
    shard: _Shard,
    chunks: _Chunks,
    pieces: Sequence[_Piece],
    chunk_shape: Sequence[int],
    item: int,
) -> int | DirectRead:
    """Fetch chunks stored back to back (one request), check each, place its parts; the
    number of elements placed."""
    chunk_nbytes = shard.layout.chunk_nbytes
    stored = chunk_nbytes + CRC_BYTES
    begin = chunks[0][0]
    nbytes = len(chunks) * stored
    data = fetch_bytes(store, shard.key, begin, begin + nbytes)
    if data is None:
        return _corrupt(f"shard object '{shard.key}' is missing")
    if len(data) != nbytes:
        return _corrupt(
            f"shard object '{shard.key}' holds {len(data)} of the {nbytes} bytes from "
            f"offset {begin} that its index points to"
        )
    placed = 0
    for index, (_, slot, numbers) in enumerate(chunks):
        at = index * stored
        chunk = data[at : at + chunk_nbytes]
        if not _crc_ok(chunk, data[at + chunk_nbytes : at + stored]):
            return _corrupt(f"{shard.chunk(slot)} fails its crc32c checksum")
        values = chunk.reshape(*chunk_shape, item)
        corner = [p.start for p in slot.box]
        for number in numbers:
            piece = pieces[number]
            part = intersect_boxes(piece.box, slot.box)
            if part is None or piece.view is None:
                continue
            into = tuple(
                slice(p.start - b.start, p.stop - b.start)
                for p, b in zip(part, piece.box, strict=True)
            )
            fro = tuple(slice(p.start - c, p.stop - c) for p, c in zip(part, corner, strict=True))
            piece.view[into] = values[fro]
            placed += math.prod(p.stop - p.start for p in part)
    return placed
