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

Three outcomes, never confused (:class:`DirectRead`):

* ``OK``: every byte read (or checked) and every checksum good;
* ``NOT_APPLICABLE``: a layout this path does not handle (compressed or scalar arrays, chunks
  that are not flat-contiguous: :mod:`~ucformat.store.direct.runs_read` reads those, an
  ``out`` that is not the range's size, an object that cannot be
  opened); the caller reads through zarr, and ``out`` may hold garbage;
* ``CORRUPT``: the bytes do not check out (a chunk or index failing its crc32c, an index entry
  that is absent or of the wrong size, an object shorter than its index says). The caller still
  reads through zarr first, so that zarr's decoder names the bad chunk where it can (docs/format.md
  §7); where zarr would return values anyway (an absent chunk reads as fill values), the caller
  raises :meth:`DirectRead.error`. Corrupt data is never returned as values.
"""

from __future__ import annotations

import enum
import math
import mmap
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import crc32c
import numpy as np
from zarr.abc.store import Store

from ucformat.errors import CorruptDataError
from ucformat.format.dtypes import itemsize
from ucformat.format.stacks import StoredArray
from ucformat.layout.chunking import is_flat_chunking
from ucformat.layout.shards import (
    ABSENT,
    CRC_BYTES,
    ChunkSlot,
    ShardLayout,
    shard_layout,
    shards_in_range,
)
from ucformat.store.checked import CheckedStore
from ucformat.store.direct.objects import fetch_bytes, local_file
from ucformat.sysio.fileio import preadv_all

__all__ = [
    "NOT_APPLICABLE",
    "OK",
    "CheckedShard",
    "DirectRead",
    "Outcome",
    "check_flat_range",
    "back_to_back",
    "check_in_place",
    "index_entry_problem",
    "read_flat_range",
]

ShardKey = Callable[[tuple[int, ...]], str]


class Outcome(enum.Enum):
    """How a direct read or check ended."""

    OK = "ok"
    NOT_APPLICABLE = "not applicable"
    CORRUPT = "corrupt"


@dataclass(frozen=True)
class DirectRead:
    """The outcome of :func:`read_flat_range` or :func:`check_flat_range`."""

    outcome: Outcome
    #: For ``CORRUPT``: what does not check out, naming the shard object and the chunk.
    problem: str = ""

    @property
    def ok(self) -> bool:
        """Every byte read (or checked) and every checksum good."""
        return self.outcome is Outcome.OK

    @property
    def corrupt(self) -> bool:
        """The store's bytes do not check out."""
        return self.outcome is Outcome.CORRUPT

    def error(self, path: str) -> CorruptDataError:
        """The error to raise for a ``CORRUPT`` outcome on the array at ``path``."""
        return CorruptDataError(
            f"{path}: {self.problem}; the store is corrupt, no values were returned "
            "(run 'ucformat verify' for a full report)."
        )


OK = DirectRead(Outcome.OK)
NOT_APPLICABLE = DirectRead(Outcome.NOT_APPLICABLE)


def _corrupt(problem: str) -> DirectRead:
    return DirectRead(Outcome.CORRUPT, problem)


def read_flat_range(
    store: Store, ref: StoredArray, shard_key: ShardKey, start: int, stop: int, out: np.ndarray
) -> DirectRead:
    """Fill ``out`` (1-D, contiguous, storage dtype) with flat elements ``[start, stop)``.

    ``out`` holds the values only if the result is ``OK`` (see the module docstring).
    """
    item = itemsize(ref.dtype)
    if out.itemsize != item or out.size != stop - start:
        return NOT_APPLICABLE
    target = out.data.cast("B")
    copied = 0
    for shard in _shard_runs(store, ref, shard_key, start, stop):
        if isinstance(shard, DirectRead):
            return shard
        for chunks in shard.runs:
            run = _Run(shard, chunks, item, start, stop, target)
            path = local_file(store, shard.key)
            result = run.read_local(path, store) if path is not None else run.read_store(store)
            if not result.ok:
                return result
            copied += run.elements
    return OK if copied == stop - start else NOT_APPLICABLE


def check_flat_range(
    store: Store, ref: StoredArray, shard_key: ShardKey, start: int, stop: int
) -> DirectRead:
    """Whether every chunk holding flat elements ``[start, stop)`` is present and passes its
    crc32c, checked in place through a read-only memory map of each (local) shard file.

    Nothing is copied and nothing is counted as read: the loader calls this on every range
    before it writes anything, then reads the ranges (:func:`read_flat_range`) straight into
    their destinations. ``NOT_APPLICABLE`` for the layouts of the module docstring and for
    stores that are not local directories (those are read into staging buffers instead).
    """
    return check_in_place(store, _shard_runs(store, ref, shard_key, start, stop))


class CheckedShard(Protocol):
    """A shard whose wanted chunks :func:`check_in_place` checks: ``runs`` are lists of
    entries ``(offset, slot, ...)`` stored back to back in the shard object ``key``."""

    @property
    def key(self) -> str:
        """The shard object's store key."""

    @property
    def layout(self) -> ShardLayout:
        """The shard's chunk layout."""

    @property
    def runs(self) -> Sequence[Sequence[tuple[Any, ...]]]:
        """The wanted chunks, as runs of ``(offset, slot, ...)`` entries."""

    def chunk(self, slot: ChunkSlot) -> str:
        """The chunk as messages name it."""


def check_in_place(store: Store, shards: Iterable[CheckedShard | DirectRead]) -> DirectRead:
    """Check the crc32c of every wanted chunk of ``shards`` in place, through read-only memory
    maps of the local shard files; the first outcome that is not ``OK`` (a ``DirectRead`` in
    ``shards`` is returned as it comes). Shared by the flat and the box-chunk readers."""
    for shard in shards:
        if isinstance(shard, DirectRead):
            return shard
        path = local_file(store, shard.key)
        if path is None:
            return NOT_APPLICABLE
        try:
            with open(path, "rb") as file:
                for chunks in shard.runs:
                    result = _check_run(file.fileno(), shard, chunks)
                    if not result.ok:
                        return result
        except ValueError:  # the file is shorter than its index says
            return _corrupt(f"shard object '{shard.key}' is shorter than its index says")
        except OSError:  # unreadable: not a finding about the data; zarr reports it
            return NOT_APPLICABLE
    return OK


_Chunks = list[tuple[int, ChunkSlot]]
#: Map pages in one go: the checksums then read them without a page fault each.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


@dataclass(frozen=True)
class _Shard:
    """One shard holding part of a range: its key, grid coordinates, layout and the wanted
    chunks as runs stored back to back (``(offset, slot)`` pairs)."""

    key: str
    coords: tuple[int, ...]
    layout: ShardLayout
    runs: list[_Chunks]

    def chunk(self, slot: ChunkSlot) -> str:
        """``chunk (3, 0) (elements [48, 64))``, as :class:`~ucformat.store.arrays.BadChunk`
        describes a chunk."""
        per_shard = self.layout.chunks_per_shard
        coords = tuple(
            s * n + c for s, n, c in zip(self.coords, per_shard, slot.local, strict=True)
        )
        where = "(" + ", ".join(map(str, coords)) + ")"
        return f"chunk {where} (elements [{slot.flat_start}, {slot.flat_start + slot.length}))"


def index_entry_problem(
    shard: CheckedShard, slot: ChunkSlot, offset: int, nbytes: int, data_end: int
) -> str | None:
    """What is wrong with a wanted chunk's index entry ``(offset, nbytes)``, or None: absent,
    not ``chunk_nbytes + 4`` bytes, or past the ``data_end`` bytes of chunks the shard can hold
    (a hostile or damaged index must not become a huge seek, mmap or allocation)."""
    stored = shard.layout.chunk_nbytes + CRC_BYTES
    if offset == ABSENT:
        return f"{shard.chunk(slot)} is absent from the index of '{shard.key}'"
    if nbytes != stored:
        return (
            f"{shard.chunk(slot)} is {nbytes} bytes in the index of '{shard.key}', "
            f"expected {stored}"
        )
    if offset + stored > data_end:
        return (
            f"{shard.chunk(slot)} is at offset {offset} in the index of '{shard.key}', "
            f"past the {data_end} bytes of chunks the shard can hold"
        )
    return None


_Entry = TypeVar("_Entry", bound=tuple[Any, ...])


def back_to_back(entries: Iterable[_Entry], stored: int) -> list[list[_Entry]]:
    """Entries ``(offset, ...)`` in offset order, grouped into runs of chunks of ``stored``
    bytes each that lie back to back in the shard object (one read or map per run)."""
    runs: list[list[_Entry]] = []
    for entry in sorted(entries, key=lambda e: int(e[0])):
        if runs and entry[0] == runs[-1][-1][0] + stored:
            runs[-1].append(entry)
        else:
            runs.append([entry])
    return runs


def _check_run(fd: int, shard: CheckedShard, chunks: Sequence[tuple[Any, ...]]) -> DirectRead:
    """Check the crc32c of chunks stored back to back, through a read-only map of their bytes."""
    chunk_nbytes = shard.layout.chunk_nbytes
    begin = chunks[0][0] - chunks[0][0] % mmap.ALLOCATIONGRANULARITY
    end = chunks[-1][0] + chunk_nbytes + CRC_BYTES
    with (
        mmap.mmap(fd, end - begin, flags=_MAP_FLAGS, prot=mmap.PROT_READ, offset=begin) as data,
        memoryview(data) as view,
    ):
        for entry in chunks:
            offset, slot = entry[0], entry[1]
            at = offset - begin
            with (
                view[at : at + chunk_nbytes] as chunk,
                view[at + chunk_nbytes : at + chunk_nbytes + CRC_BYTES] as checksum,
            ):
                if not _crc_ok(chunk, checksum):
                    return _corrupt(f"{shard.chunk(slot)} fails its crc32c checksum")
    return OK


def _shard_runs(
    store: Store, ref: StoredArray, shard_key: ShardKey, start: int, stop: int
) -> Iterator[_Shard | DirectRead]:
    """Each shard holding part of ``[start, stop)``, in order; a last ``NOT_APPLICABLE`` or
    ``CORRUPT`` where the array's layout or a shard's index does not allow a direct read."""
    item = itemsize(ref.dtype)
    if ref.compressor != "none" or not ref.shape or start >= stop:
        yield NOT_APPLICABLE
        return
    if not is_flat_chunking(ref.shape, ref.chunk_shape):  # box chunks: runs_read reads them
        yield NOT_APPLICABLE
        return
    for coords in shards_in_range(ref.shape, ref.shard_shape, start, stop):
        try:
            layout = shard_layout(ref.shape, ref.chunk_shape, ref.shard_shape, item, coords)
        except ValueError:
            yield NOT_APPLICABLE
            return
        key = shard_key(coords)
        entries = _index(store, key, layout.chunks_per_shard, layout.index_nbytes)
        if isinstance(entries, DirectRead):
            yield entries
            return
        shard = _Shard(key, coords, layout, [])
        stored = layout.chunk_nbytes + CRC_BYTES
        # A shard object holds its chunks and its index: no entry may point past them (a
        # hostile or damaged index must not become a huge seek, mmap or allocation).
        data_end = math.prod(layout.chunks_per_shard) * stored + layout.index_nbytes
        wanted: _Chunks = []
        for slot in layout.slots:
            if slot.flat_start < stop and slot.flat_start + slot.length > start:
                offset, nbytes = (int(v) for v in entries[slot.local])
                problem = index_entry_problem(shard, slot, offset, nbytes, data_end)
                if problem is not None:
                    yield _corrupt(problem)
                    return
                wanted.append((offset, slot))
        shard.runs.extend(back_to_back(wanted, stored))
        yield shard


class _Run:
    """Chunks stored back to back in one shard object, and where their wanted parts go."""

    def __init__(
        self,
        shard: _Shard,
        chunks: Sequence[tuple[int, ChunkSlot]],
        item: int,
        start: int,
        stop: int,
        target: memoryview,
    ) -> None:
        self.shard = shard
        self.chunks = chunks
        self.chunk_nbytes = chunk_nbytes = shard.layout.chunk_nbytes
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

    def _short(self, got: int) -> DirectRead:
        return _corrupt(
            f"shard object '{self.shard.key}' holds {got} of the {self.nbytes} bytes from "
            f"offset {self.begin} that its index points to"
        )

    def _bad(self, index: int) -> DirectRead:
        return _corrupt(f"{self.shard.chunk(self.chunks[index][1])} fails its crc32c checksum")

    def read_store(self, store: Store) -> DirectRead:
        """One range request through the store, then checks and copies."""
        data = fetch_bytes(store, self.shard.key, self.begin, self.begin + self.nbytes)
        if data is None:  # a store that does not raise for missing objects
            return _corrupt(f"shard object '{self.shard.key}' is missing")
        if len(data) != self.nbytes:
            return self._short(len(data))
        source = data.data
        for index in range(len(self.chunks)):
            at = index * (self.chunk_nbytes + CRC_BYTES)
            chunk = source[at : at + self.chunk_nbytes]
            if not _crc_ok(chunk, source[at + self.chunk_nbytes : at + self.chunk_nbytes + 4]):
                return self._bad(index)
            low, _, whole = self.parts[index]
            if whole:
                into = (low - self.start) * self.item
                self.target[into : into + self.chunk_nbytes] = chunk
            else:
                self._place(index, chunk)
        return OK

    def read_local(self, path: object, store: Store) -> DirectRead:
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
        except OSError:  # removed since its index was read, or unreadable: zarr reports it
            return NOT_APPLICABLE
        try:
            got = preadv_all(fd, views, self.begin)
        finally:
            os.close(fd)
        if got != self.nbytes:
            return self._short(got)
        if isinstance(store, CheckedStore):
            store.stats.add(got)
        for index, chunk in enumerate(chunks):
            checksum = views[2 * index + 1]
            if not _crc_ok(chunk, checksum):
                return self._bad(index)
            self._place(index, chunk)
        return OK


def _crc_ok(chunk: memoryview, checksum: memoryview) -> bool:
    return bool(crc32c.crc32c(chunk) == int.from_bytes(checksum, "little"))


def _index(
    store: Store, key: str, chunks_per_shard: tuple[int, ...], nbytes: int
) -> np.ndarray | DirectRead:
    """The shard's index as ``(*chunks_per_shard, 2)`` uint64, or why it does not check out."""
    raw = fetch_bytes(store, key, suffix=nbytes)
    if raw is None:  # a store that does not raise for missing objects
        return _corrupt(f"shard object '{key}' is missing")
    if len(raw) != nbytes:
        return _corrupt(f"shard object '{key}' is {len(raw)} bytes, shorter than its index")
    body = raw.data[: nbytes - CRC_BYTES]
    if not _crc_ok(body, raw.data[nbytes - CRC_BYTES :]):
        return _corrupt(f"the index of shard object '{key}' fails its crc32c checksum")
    return np.frombuffer(body, dtype="<u8").reshape(*chunks_per_shard, 2)
