"""Encode uncompressed shard objects straight from the source fragments (the converter's path).

A shard object (:mod:`ucformat.layout.shards`) is its chunks in zarr's order, each followed by
its crc32c, then the index and its crc32c. :class:`ShardEncoder` fills any run of consecutive
chunks of it into a byte buffer: ``preadv`` scatters each source fragment directly into the
chunks it fills (one copy, from the page cache), edge-chunk padding is zeroed, and each chunk's
crc32c is computed in place. Two ways to use it:

* :func:`stream_shard` writes the object to a file window by window through one small buffer
  that each worker reuses for every shard (local stores): the copies stay in the CPU cache, the
  buffer's pages are touched once per worker, and memory does not depend on the shard size;
* :func:`encode_shard` builds the whole object in one buffer (any other store, then one
  ``store.set``).

Either way the bytes are exactly those zarr writes for the same region
(``tests/store/direct/test_shard_write.py``, ``tests/store/direct/test_shard_encoding.py``);
zarr's per-chunk encode (a coroutine, a checksum copy and a shard copy per chunk) is what this
avoids.

A shard of a stack (docs/format.md §2.5) that holds one logical array is encoded in that
array's own geometry (the stack's leading axis dropped, :func:`squeezed`): its chunk grid has
extent 1 on that axis, which takes no bits of zarr's Morton order and no room in the index,
so the bytes are those of the logical array's shard, and a matrix's box chunks take the fast
path below.
"""

from __future__ import annotations

import bisect
import functools
import math
import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import crc32c
import numpy as np
from numpy.lib.stride_tricks import as_strided

from ucformat.format.dtypes import itemsize, torch_to_storage
from ucformat.format.stacks import StoredArray
from ucformat.layout.chunking import is_flat_chunking
from ucformat.layout.shards import (
    ABSENT,
    CRC_BYTES,
    ChunkSlot,
    ShardLayout,
    box_runs,
    shard_layout,
)
from ucformat.sysio.fileio import pwrite_all
from ucformat.write.plan import CopyItem, WriteUnit

__all__ = [
    "WINDOW_BYTES",
    "ShardEncoder",
    "encode_shard",
    "shard_of",
    "squeezed",
    "stream_shard",
]

#: Bytes of chunks (with their checksums) a streaming writer fills and writes at a time: small
#: enough to stay in a core's L2 cache between the fill and the ``pwrite`` (4 MiB did not:
#: a 100m model's save took 1.6x the CPU time, docs/benchmarks.md).
WINDOW_BYTES = 512 * 1024


def shard_of(ref: StoredArray, unit: WriteUnit) -> tuple[int, ...]:
    """The coordinates, in the shard grid, of the shard ``unit`` fills."""
    return tuple(p.start // size for p, size in zip(unit.region, ref.shard_shape, strict=True))


def squeezed(ref: StoredArray, unit: WriteUnit) -> tuple[StoredArray, WriteUnit]:
    """``ref`` and ``unit`` without a leading axis whose shards are 1 deep (a stack's shard
    holding one logical array): the same shard object's bytes, in the logical array's own
    geometry (its flat range relative to the array). Anything else is returned as it is."""
    if len(ref.shape) < 2 or ref.shard_shape[0] != 1 or ref.chunk_shape[0] != 1:
        return ref, unit
    base = unit.region[0].start * math.prod(ref.shape[1:])
    inner = replace(
        ref, shape=ref.shape[1:], chunk_shape=ref.chunk_shape[1:], shard_shape=ref.shard_shape[1:]
    )
    return inner, replace(
        unit, region=unit.region[1:], flat_start=unit.flat_start - base,
        flat_stop=unit.flat_stop - base,
    )  # fmt: skip


class ShardEncoder:
    """Fills the chunks of one :class:`~ucformat.write.plan.WriteUnit`'s shard object.

    Raises:
        ValueError: the array is 0-d or compressed, or the shard is not one flat range.
    """

    def __init__(self, ref: StoredArray, unit: WriteUnit) -> None:
        if ref.compressor != "none" or not ref.shape:
            raise ValueError(f"{ref.path}: only uncompressed n-d shards are encoded here")
        self.item = itemsize(ref.dtype)
        #: The shard's coordinates in the stored array's grid (its key).
        self.shard = shard_of(ref, unit)
        ref, unit = squeezed(ref, unit)
        coords = shard_of(ref, unit)
        self.layout: ShardLayout = shard_layout(
            ref.shape, ref.chunk_shape, ref.shard_shape, self.item, coords
        )
        runs = sorted(self.layout.slots, key=lambda slot: slot.flat_start)
        if sum(s.length for s in runs) != unit.numel or runs[0].flat_start != unit.flat_start:
            raise ValueError(f"{ref.path}: shard {self.shard} is not one flat range of chunks")
        self.path = ref.path
        self.flat_start = unit.flat_start
        self.copies: tuple[CopyItem, ...] = tuple(sorted(unit.copies, key=lambda c: c.offset))
        self._copy_starts = [unit.flat_start + copy.offset for copy in self.copies]
        #: A matrix in box chunks: filled through a staging band of whole rows (``_fill_rows``).
        self._boxed = len(ref.shape) == 2 and not is_flat_chunking(ref.shape, ref.chunk_shape)
        self._shape = tuple(ref.shape)
        self._chunk = tuple(ref.chunk_shape)
        self._key: _LayoutKey = (
            self._shape,
            self._chunk,
            tuple(ref.shard_shape),
            self.item,
            coords,
        )

    @property
    def stored(self) -> int:
        """Bytes of one stored chunk with its checksum."""
        return self.layout.chunk_nbytes + CRC_BYTES

    def windows(self, limit: int) -> Iterator[Sequence[ChunkSlot]]:
        """The chunks in storage order, in runs of at most ``limit`` bytes (at least one).

        With box chunks a window holds a power of two of chunks: an aligned block of zarr's
        Morton order, i.e. whole rows of chunks, whose runs are long runs of the source.
        """
        per = max(1, limit // self.stored)
        if self.layout.slots and not self.layout.slots[0].contiguous:
            per = 1 << (per.bit_length() - 1)
        slots = self.layout.slots
        for first in range(0, len(slots), per):
            yield slots[first : first + per]

    def fill(self, buffer: memoryview, slots: Sequence[ChunkSlot]) -> None:
        """Write ``slots`` (consecutive in storage order) with their checksums into ``buffer``.

        ``buffer[0]`` is the object's byte ``slots[0].offset``. A chunk is one run of the array
        (flat-contiguous chunks) or several (box chunks: one per row); each run is filled from
        the copies that hold it.
        """
        base, item, chunk = slots[0].offset, self.item, self.layout.chunk_nbytes
        if self._boxed:
            self._fill_rows(buffer, slots)
            self._checksums(buffer, slots)
            return
        reads: dict[int, list[tuple[int, int, memoryview]]] = {}
        for slot in sorted(slots, key=lambda s: s.flat_start):
            at = slot.offset - base
            if slot.length * item < chunk:  # an edge chunk: padding holds the fill value 0
                if slot.contiguous:
                    buffer[at + slot.length * item : at + chunk] = bytes(chunk - slot.length * item)
                else:
                    buffer[at : at + chunk] = bytes(chunk)
            runs = slot.runs or box_runs(self._shape, self._chunk, slot.box)
            for flat, position, length in runs:
                stop = flat + length
                index = max(0, bisect.bisect_right(self._copy_starts, flat) - 1)
                while index < len(self.copies) and self._copy_starts[index] < stop:
                    low = max(flat, self._copy_starts[index])
                    high = min(stop, self._copy_starts[index] + self.copies[index].length)
                    if low < high:
                        into = at + (position + low - flat) * item
                        reads.setdefault(index, []).append(
                            (low, high, buffer[into : into + (high - low) * item])
                        )
                    index += 1
        for index, pieces in reads.items():
            pieces.sort(key=lambda piece: piece[0])
            self._read(self.copies[index], self._copy_starts[index], pieces)
        self._checksums(buffer, slots)

    def _checksums(self, buffer: memoryview, slots: Sequence[ChunkSlot]) -> None:
        """Each chunk's crc32c after it (``slots`` lie back to back from ``buffer[0]``)."""
        chunk, stored, count = self.layout.chunk_nbytes, self.stored, len(slots)
        sums = [crc32c.crc32c(buffer[at : at + chunk]) for at in range(0, count * stored, stored)]
        tails = np.frombuffer(buffer, dtype=np.uint8)[chunk:]
        as_strided(tails, shape=(count, CRC_BYTES), strides=(stored, 1))[...] = (
            np.array(sums, dtype="<u4").view(np.uint8).reshape(count, CRC_BYTES)
        )

    def _fill_rows(self, buffer: memoryview, slots: Sequence[ChunkSlot]) -> None:
        """Box chunks of a matrix: the whole rows the slots span, in place in memory
        (:meth:`_band_in_memory`) or read into a staging band (one read per copy), then every
        whole chunk's block copied out of them in batches (one numpy copy per batch) and each
        edge chunk on its own (a window of whole rows of chunks, as :meth:`windows` gives,
        spans exactly its own rows)."""
        item, columns = self.item, self._shape[1]
        grid = _tables(self._key)
        first_slot = slots[0].offset // self.stored
        window = slice(first_slot, first_slot + len(slots))
        first, last = int(grid.row_start[window].min()), int(grid.row_stop[window].max())
        start, stop = first * columns, last * columns
        staging = self._band_in_memory(start, stop)
        if staging is None:
            staging = np.empty((stop - start) * item, dtype=np.uint8)
            view = staging.data
            index = max(0, bisect.bisect_right(self._copy_starts, start) - 1)
            while index < len(self.copies) and self._copy_starts[index] < stop:
                low = max(start, self._copy_starts[index])
                high = min(stop, self._copy_starts[index] + self.copies[index].length)
                if low < high:
                    piece = view[(low - start) * item : (high - start) * item]
                    self._read(self.copies[index], self._copy_starts[index], [(low, high, piece)])
                index += 1
        band = staging.reshape(last - first, columns * item)
        out = np.frombuffer(buffer, dtype=np.uint8)
        rows, cols = self._chunk
        width, row_bytes = cols * item, columns * item
        whole = np.flatnonzero(grid.whole[window])
        if whole.size:
            # the band as (chunk row, chunk column, row in chunk, bytes of the row) and the
            # window as (chunk, row in chunk, bytes of the row): views, no copies
            blocks = as_strided(
                band, shape=((last - first) // rows, columns // cols, rows, width),
                strides=(rows * row_bytes, width, row_bytes, 1),
            )  # fmt: skip
            chunks = as_strided(
                out, shape=(len(slots), rows, width), strides=(self.stored, width, 1)
            )
            grid_rows = (grid.row_start[window][whole] - first) // rows
            grid_columns = grid.column_start[window][whole] // cols
            for at in range(0, whole.size, _BATCH):
                part = slice(at, at + _BATCH)
                chunks[whole[part]] = blocks[grid_rows[part], grid_columns[part]]
        base, chunk = slots[0].offset, self.layout.chunk_nbytes
        for position in np.flatnonzero(~grid.whole[window]).tolist():
            slot = slots[position]
            at = slot.offset - base
            target = out[at : at + chunk].reshape(rows, width)
            (a, b), (c, d) = ((p.start, p.stop) for p in slot.box)
            target[...] = 0  # an edge chunk: padding holds the fill value 0
            target[: b - a, : (d - c) * item] = band[a - first : b - first, c * item : d * item]

    def _band_in_memory(self, start: int, stop: int) -> np.ndarray | None:
        """Elements ``[start, stop)`` as the bytes of the one in-memory source holding them all
        (a live save's tensor: ``memory_span``), without a staging copy; else None."""
        index = max(0, bisect.bisect_right(self._copy_starts, start) - 1)
        if index >= len(self.copies):
            return None
        copy, copy_start = self.copies[index], self._copy_starts[index]
        span = getattr(copy.fragment.tensor, "memory_span", None)
        if span is None or copy_start > start or copy_start + copy.length < stop:
            return None
        band: np.ndarray = span(copy.tensor_start + start - copy_start, stop - start)
        return band

    def _read(
        self, copy: CopyItem, copy_start: int, pieces: list[tuple[int, int, memoryview]]
    ) -> None:
        """Read the parts of ``copy`` that ``pieces`` (flat order) need into their views."""
        tensor = copy.fragment.tensor
        if not tensor.is_contiguous():
            whole = torch_to_storage(tensor.load()).reshape(-1).data.cast("B")
            for low, high, view in pieces:
                first = (copy.tensor_start + low - copy_start) * self.item
                view[:] = whole[first : first + (high - low) * self.item]
            return
        group_start, group = pieces[0][0], [pieces[0][2]]
        previous_high = pieces[0][1]
        for low, high, view in pieces[1:]:
            if low != previous_high:  # not adjacent in the source: one read per run
                tensor.read_scattered(copy.tensor_start + group_start - copy_start, group)
                group_start, group = low, []
            group.append(view)
            previous_high = high
        tensor.read_scattered(copy.tensor_start + group_start - copy_start, group)

    def index_bytes(self) -> bytes:
        """The shard index with its checksum (the object's last bytes)."""
        return _tables(self._key).index


#: Whole box chunks copied per numpy call (their temporary stays in the CPU cache).
_BATCH = 64


@dataclass(frozen=True)
class _ShardTables:
    """What every shard of one layout shares: its index bytes and, for box chunks of a matrix,
    per chunk in storage order its first and end row and first column in the array, and
    whether it is whole (no edge padding)."""

    index: bytes
    row_start: np.ndarray
    row_stop: np.ndarray
    column_start: np.ndarray
    whole: np.ndarray


#: What decides a shard's layout: shape, chunk shape, shard shape, itemsize, shard coordinates.
_LayoutKey = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]


@functools.lru_cache(maxsize=256)
def _tables(key: _LayoutKey) -> _ShardTables:
    layout = shard_layout(*key)
    shape, chunk = key[0], key[1]
    stored = layout.chunk_nbytes + CRC_BYTES
    entries = np.full((*layout.chunks_per_shard, 2), ABSENT, dtype="<u8")
    for slot in layout.slots:
        entries[slot.local] = (slot.offset, stored)
    raw = entries.tobytes()
    boxes = np.zeros((len(layout.slots), 4), dtype=np.int64)
    if len(shape) == 2:
        boxes[:] = [[b[0].start, b[0].stop, b[1].start, b[1].stop]
                    for b in (slot.box for slot in layout.slots)]  # fmt: skip
    whole = (boxes[:, 1] - boxes[:, 0] == chunk[0]) & (boxes[:, 3] - boxes[:, 2] == chunk[-1])
    index = raw + crc32c.crc32c(raw).to_bytes(4, "little")
    return _ShardTables(index, boxes[:, 0], boxes[:, 1], boxes[:, 2], whole)


def encode_shard(ref: StoredArray, unit: WriteUnit) -> tuple[tuple[int, ...], np.ndarray]:
    """The shard coordinates of ``unit`` and its whole stored object, as ``uint8``."""
    encoder = ShardEncoder(ref, unit)
    layout = encoder.layout
    # A private anonymous mapping, unmapped as soon as the shard is written: shards of every
    # size never fragment the heap.
    buffer = np.frombuffer(mmap.mmap(-1, layout.nbytes), dtype=np.uint8)
    view = buffer.data
    encoder.fill(view, layout.slots)
    view[layout.index_offset :] = encoder.index_bytes()
    return encoder.shard, buffer


def stream_shard(fd: int, ref: StoredArray, unit: WriteUnit, scratch: memoryview) -> int:
    """Write ``unit``'s shard object to the file ``fd`` through ``scratch``; its size in bytes.

    ``scratch`` is any buffer (at least one stored chunk is used even if it is smaller).
    """
    encoder = ShardEncoder(ref, unit)
    if len(scratch) < encoder.stored:
        scratch = memoryview(bytearray(encoder.stored))
    for slots in encoder.windows(len(scratch)):
        size = len(slots) * encoder.stored
        encoder.fill(scratch[:size], slots)
        pwrite_all(fd, scratch[:size], slots[0].offset)
    pwrite_all(fd, memoryview(encoder.index_bytes()), encoder.layout.index_offset)
    return encoder.layout.nbytes
