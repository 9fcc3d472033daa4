"""Read a flat range of an uncompressed sharded array straight from its shard objects.

The reader's fast path (``UniversalCheckpoint.read_range_into``). For every shard that holds
part of ``[start, stop)``: fetch the shard index (a suffix read through the store, cached per
reader, exactly as zarr does), check its crc32c, look up the chunks that hold the range, and
read each run of chunks that lie back to back in the object with one request:

* on a local directory store, one ``preadv`` scatters the run straight into the caller's buffer
  (whole chunks land where they belong; only the at most two chunks cut by the range, chunks
  padded at the array's edge and the 4-byte checksums go to scratch space), so each byte is
  copied once, from the page cache into its destination;
* on any other store, one range request through the store, then a copy of each wanted part.

Every chunk's crc32c is checked where it landed. The bytes fetched are those zarr fetches for the
same read (the chunks and the index: :mod:`ucformat.layout.reads`), and they are counted in the
reader's :class:`~ucformat.zarr_io.IOStats`; what is saved is zarr's per-chunk decode (a
coroutine, an output array and a copy per chunk) and the reader's copy out of zarr's result.

Anything unexpected (a bad checksum, an index entry that is absent or of the wrong size, a short
or missing object, a layout that does not tile the range) makes :func:`read_flat_range` return
False; the caller then reads through zarr, which raises the error that names the array and the
chunk (docs/format.md §7). ``out`` may then hold garbage, never data the caller trusts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import crc32c
import numpy as np
from zarr.abc.store import Store

from ucformat.dtypes import itemsize
from ucformat.layout.shards import ABSENT, CRC_BYTES, ChunkSlot, shard_layout, shards_in_range
from ucformat.models import ArrayRef
from ucformat.zarr_io import CheckedStore, fetch_bytes, local_file

__all__ = ["read_flat_range"]

ShardKey = Callable[[tuple[int, ...]], str]
#: Most buffers one ``preadv`` call takes (Linux ``IOV_MAX``).
_IOV_MAX = 1024


def read_flat_range(
    store: Store, ref: ArrayRef, shard_key: ShardKey, start: int, stop: int, out: np.ndarray
) -> bool:
    """Fill ``out`` (1-D, contiguous, storage dtype) with flat elements ``[start, stop)``.

    Returns False if the store's bytes do not check out.
    """
    item = itemsize(ref.dtype)
    if ref.compressor != "none" or not ref.shape or start >= stop or out.itemsize != item:
        return False
    target = out.data.cast("B")
    copied = 0
    for shard in shards_in_range(ref.shape, ref.shard_shape, start, stop):
        try:
            layout = shard_layout(ref.shape, ref.chunk_shape, ref.shard_shape, item, shard)
        except ValueError:
            return False
        key = shard_key(shard)
        entries = _index(store, key, layout.chunks_per_shard, layout.index_nbytes)
        if entries is None:
            return False
        stored = layout.chunk_nbytes + CRC_BYTES
        wanted: list[tuple[int, ChunkSlot]] = []
        for slot in layout.slots:
            if slot.flat_start < stop and slot.flat_start + slot.length > start:
                offset, nbytes = (int(v) for v in entries[slot.local])
                if offset == ABSENT or nbytes != stored:
                    return False
                wanted.append((offset, slot))
        wanted.sort(key=lambda pair: pair[0])
        path = local_file(store, key)
        first = 0
        while first < len(wanted):
            last = first
            while last + 1 < len(wanted) and wanted[last + 1][0] == wanted[last][0] + stored:
                last += 1
            run = _Run(wanted[first : last + 1], layout.chunk_nbytes, item, start, stop, target)
            ok = run.read_local(path, store) if path is not None else run.read_store(store, key)
            if not ok:
                return False
            copied += run.elements
            first = last + 1
    return copied == stop - start


class _Run:
    """Chunks stored back to back in one shard object, and where their wanted parts go."""

    def __init__(
        self,
        chunks: Sequence[tuple[int, ChunkSlot]],
        chunk_nbytes: int,
        item: int,
        start: int,
        stop: int,
        target: memoryview,
    ) -> None:
        self.chunks = chunks
        self.chunk_nbytes = chunk_nbytes
        self.begin = chunks[0][0]
        self.nbytes = len(chunks) * (chunk_nbytes + CRC_BYTES)
        #: Per chunk: (first wanted element, one past the last, whether it is taken whole).
        self.parts: list[tuple[int, int, bool]] = []
        for _, slot in chunks:
            low, high = max(start, slot.flat_start), min(stop, slot.flat_start + slot.length)
            whole = low == slot.flat_start and (high - low) * item == chunk_nbytes
            self.parts.append((low, high, whole))
        self.elements = sum(high - low for low, high, _ in self.parts)
        self.item, self.start, self.target = item, start, target

    def _place(self, index: int, chunk: memoryview) -> None:
        low, high, whole = self.parts[index]
        if whole:
            return  # already in place
        slot = self.chunks[index][1]
        into = (low - self.start) * self.item
        fro = (low - slot.flat_start) * self.item
        size = (high - low) * self.item
        self.target[into : into + size] = chunk[fro : fro + size]

    def read_store(self, store: Store, key: str) -> bool:
        """One range request through the store, then checks and copies."""
        data = fetch_bytes(store, key, self.begin, self.begin + self.nbytes)
        if data is None or len(data) != self.nbytes:
            return False
        source = data.data
        for index in range(len(self.chunks)):
            at = index * (self.chunk_nbytes + CRC_BYTES)
            chunk = source[at : at + self.chunk_nbytes]
            if not _crc_ok(chunk, source[at + self.chunk_nbytes : at + self.chunk_nbytes + 4]):
                return False
            low, _, whole = self.parts[index]
            if whole:
                into = (low - self.start) * self.item
                self.target[into : into + self.chunk_nbytes] = chunk
            else:
                self._place(index, chunk)
        return True

    def read_local(self, path: object, store: Store) -> bool:
        """One ``preadv`` from the shard file straight into place."""
        scratch = np.empty(
            sum(1 for *_, whole in self.parts if not whole) * self.chunk_nbytes
            + CRC_BYTES * len(self.chunks),
            dtype=np.uint8,
        )
        spare = scratch.data
        views: list[memoryview] = []
        chunks: list[memoryview] = []
        used = 0
        for low, _, whole in self.parts:
            if whole:
                into = (low - self.start) * self.item
                chunk = self.target[into : into + self.chunk_nbytes]
            else:
                chunk = spare[used : used + self.chunk_nbytes]
                used += self.chunk_nbytes
            chunks.append(chunk)
            views += [chunk, spare[used : used + CRC_BYTES]]
            used += CRC_BYTES
        try:
            fd = os.open(str(path), os.O_RDONLY)
        except OSError:
            return False
        try:
            got = _preadv_all(fd, views, self.begin)
        finally:
            os.close(fd)
        if got != self.nbytes:
            return False
        if isinstance(store, CheckedStore):
            store.stats.add(got)
        for index, chunk in enumerate(chunks):
            checksum = views[2 * index + 1]
            if not _crc_ok(chunk, checksum):
                return False
            self._place(index, chunk)
        return True


def _crc_ok(chunk: memoryview, checksum: memoryview) -> bool:
    return bool(crc32c.crc32c(chunk) == int.from_bytes(checksum, "little"))


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` in turn from ``offset``; the number of bytes read (short at end of file)."""
    total, first = 0, 0
    pending = list(views)
    while first < len(pending):
        got = os.preadv(fd, pending[first : first + _IOV_MAX], offset + total)
        if got <= 0:
            break
        total += got
        while first < len(pending) and got >= len(pending[first]):
            got -= len(pending[first])
            first += 1
        if got:
            pending[first] = pending[first][got:]
    return total


def _index(
    store: Store, key: str, chunks_per_shard: tuple[int, ...], nbytes: int
) -> np.ndarray | None:
    """The shard's index as ``(*chunks_per_shard, 2)`` uint64, or None if it fails its crc."""
    raw = fetch_bytes(store, key, suffix=nbytes)
    if raw is None or len(raw) != nbytes:
        return None
    body = raw.data[: nbytes - CRC_BYTES]
    if not _crc_ok(body, raw.data[nbytes - CRC_BYTES :]):
        return None
    return np.frombuffer(body, dtype="<u8").reshape(*chunks_per_shard, 2)
