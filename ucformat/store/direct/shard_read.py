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
reader's :class:`~ucformat.store.checked.IOStats`; what is saved is zarr's per-chunk decode (a
coroutine, an output array and a copy per chunk) and the reader's copy out of zarr's result.

Anything unexpected (a bad checksum, an index entry that is absent or of the wrong size, a short
or missing object, a layout that does not tile the range) makes :func:`read_flat_range` return
False; the caller then reads through zarr, which raises the error that names the array and the
chunk (docs/format.md §7). ``out`` may then hold garbage, never data the caller trusts.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator, Sequence

import crc32c
import numpy as np
from zarr.abc.store import Store

from ucformat.dtypes import itemsize
from ucformat.layout.shards import (
    ABSENT,
    CRC_BYTES,
    ChunkSlot,
    ShardLayout,
    shard_layout,
    shards_in_range,
)
from ucformat.models import ArrayRef
from ucformat.store.checked import CheckedStore
from ucformat.store.direct.fileio import preadv_all
from ucformat.store.direct.objects import fetch_bytes, local_file

__all__ = ["check_flat_range", "read_flat_range"]

ShardKey = Callable[[tuple[int, ...]], str]


def read_flat_range(
    store: Store, ref: ArrayRef, shard_key: ShardKey, start: int, stop: int, out: np.ndarray
) -> bool:
    """Fill ``out`` (1-D, contiguous, storage dtype) with flat elements ``[start, stop)``.

    Returns False if the store's bytes do not check out.
    """
    item = itemsize(ref.dtype)
    if out.itemsize != item or out.size != stop - start:
        return False
    target = out.data.cast("B")
    copied = 0
    for shard in _shard_runs(store, ref, shard_key, start, stop):
        if shard is None:
            return False
        key, layout, runs = shard
        path = local_file(store, key)
        for chunks in runs:
            run = _Run(chunks, layout.chunk_nbytes, item, start, stop, target)
            ok = run.read_local(path, store) if path is not None else run.read_store(store, key)
            if not ok:
                return False
            copied += run.elements
    return copied == stop - start


def check_flat_range(
    store: Store, ref: ArrayRef, shard_key: ShardKey, start: int, stop: int
) -> bool:
    """Whether every chunk holding flat elements ``[start, stop)`` is present and passes its
    crc32c, checked in place through a read-only memory map of each (local) shard file.

    Nothing is copied and nothing is counted as read: the loader calls this on every range
    before it writes anything, then reads the ranges (:func:`read_flat_range`) straight into
    their destinations. False for anything that does not check out, and for stores that are not
    local directories (those are read into staging buffers instead).
    """
    for shard in _shard_runs(store, ref, shard_key, start, stop):
        path = local_file(store, shard[0]) if shard is not None else None
        if shard is None or path is None:
            return False
        _, layout, runs = shard
        try:
            with open(path, "rb") as file:
                for chunks in runs:
                    if not _check_run(file.fileno(), chunks, layout.chunk_nbytes):
                        return False
        except (OSError, ValueError):  # missing or unreadable file, or shorter than its index says
            return False
    return True


_Chunks = list[tuple[int, ChunkSlot]]
#: Map pages in one go: the checksums then read them without a page fault each.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _check_run(fd: int, chunks: _Chunks, chunk_nbytes: int) -> bool:
    """Check the crc32c of chunks stored back to back, through a read-only map of their bytes."""
    begin = chunks[0][0] - chunks[0][0] % mmap.ALLOCATIONGRANULARITY
    end = chunks[-1][0] + chunk_nbytes + CRC_BYTES
    with (
        mmap.mmap(fd, end - begin, flags=_MAP_FLAGS, prot=mmap.PROT_READ, offset=begin) as data,
        memoryview(data) as view,
    ):
        for offset, _ in chunks:
            at = offset - begin
            with (
                view[at : at + chunk_nbytes] as chunk,
                view[at + chunk_nbytes : at + chunk_nbytes + CRC_BYTES] as checksum,
            ):
                if not _crc_ok(chunk, checksum):
                    return False
    return True


def _shard_runs(
    store: Store, ref: ArrayRef, shard_key: ShardKey, start: int, stop: int
) -> Iterator[tuple[str, ShardLayout, list[_Chunks]] | None]:
    """Per shard holding part of ``[start, stop)``: its key, layout, and the wanted chunks as
    runs stored back to back (``(offset, slot)`` pairs); a last None where the shard's index
    (or the array's layout) does not check out."""
    item = itemsize(ref.dtype)
    if ref.compressor != "none" or not ref.shape or start >= stop:
        yield None
        return
    for shard in shards_in_range(ref.shape, ref.shard_shape, start, stop):
        try:
            layout = shard_layout(ref.shape, ref.chunk_shape, ref.shard_shape, item, shard)
        except ValueError:
            yield None
            return
        key = shard_key(shard)
        entries = _index(store, key, layout.chunks_per_shard, layout.index_nbytes)
        stored = layout.chunk_nbytes + CRC_BYTES
        wanted: _Chunks = []
        for slot in layout.slots if entries is not None else ():
            if slot.flat_start < stop and slot.flat_start + slot.length > start:
                offset, nbytes = (int(v) for v in entries[slot.local])  # type: ignore[index]
                if offset == ABSENT or nbytes != stored:
                    entries = None
                    break
                wanted.append((offset, slot))
        if entries is None:
            yield None
            return
        wanted.sort(key=lambda pair: pair[0])
        runs: list[_Chunks] = []
        for pair in wanted:
            if runs and pair[0] == runs[-1][-1][0] + stored:
                runs[-1].append(pair)
            else:
                runs.append([pair])
        yield key, layout, runs


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
            got = preadv_all(fd, views, self.begin)
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
