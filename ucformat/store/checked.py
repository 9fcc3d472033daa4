"""A zarr store wrapper that counts reads, caches shard indexes and refuses missing data.

Reads of a store go through :class:`CheckedStore`, which counts the bytes and requests a reader
makes (:class:`IOStats`), keeps recently read shard indexes, and turns a missing data object into
:class:`~ucformat.errors.ChunkMissingError` rather than zarr's silent fill value.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from zarr.abc.buffer import Buffer, BufferPrototype
from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.buffer import default_buffer_prototype
from zarr.storage import WrapperStore

from ucformat.errors import ChunkMissingError
from ucformat.store.keys import run

__all__ = ["CheckedStore", "IOStats"]


@dataclass
class IOStats:
    """Bytes and requests served by a :class:`CheckedStore` (shared by its copies)."""

    bytes_read: int = 0
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int) -> None:
        """Count one request that returned ``nbytes``."""
        with self._lock:
            self.bytes_read += nbytes
            self.requests += 1


class _IndexCache:
    """Recently read shard indexes (suffix reads), so a reader fetches each index once."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple[str, int], Buffer] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> Buffer | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: tuple[str, int], value: Buffer) -> None:
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)


class CheckedStore(WrapperStore[Store]):
    """A store wrapper that counts reads, caches shard indexes and refuses missing data."""

    def __init__(
        self, store: Store, stats: IOStats | None = None, cache: _IndexCache | None = None
    ) -> None:
        super().__init__(store)
        self.stats = stats if stats is not None else IOStats()
        self._cache = cache if cache is not None else _IndexCache()

    @property
    def wrapped(self) -> Store:
        """The store this one reads from."""
        return self._store

    def _with_store(self, store: Store) -> CheckedStore:
        return CheckedStore(store, self.stats, self._cache)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        cache_key = (key, byte_range.suffix) if isinstance(byte_range, SuffixByteRequest) else None
        if cache_key is not None and (cached := self._cache.get(cache_key)) is not None:
            return cached
        result = await self._store.get(key, prototype, byte_range)
        if result is not None and cache_key is not None:
            self._cache.put(cache_key, result)
        if result is None:
            # a chunk key (docs/format.md §2.1): ".../c/<i>/..." or ".../c" (format 3.0 and
            # older; a param named "c" has metadata under ".../c/..."), ".../c.<i>..." (stacks)
            name = key.rpartition("/")[2]
            if name != "zarr.json" and ("/c/" in key or name == "c" or name.startswith("c.")):
                raise ChunkMissingError(
                    f"{key}: this chunk object is missing from the store; the store is damaged "
                    "(re-run the convert, or restore the object)."
                )
            return None
        self.stats.add(len(result))
        return result

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        pairs = list(key_ranges)
        results = await self._store.get_partial_values(prototype, pairs)
        for (key, _), result in zip(pairs, results, strict=True):
            if result is None:
                raise ChunkMissingError(f"{key}: this chunk object is missing from the store.")
            self.stats.add(len(result))
        return results

    def get_local(self, path: Path, key: str, byte_range: ByteRequest | None) -> Buffer | None:
        """What :meth:`get` returns for ``key``, read with ``pread`` from ``path``, the local
        file holding it: no round trip through zarr's event loop (counted and cached the same
        way). A missing file goes through :meth:`get`, which says what is missing."""
        cache_key = (key, byte_range.suffix) if isinstance(byte_range, SuffixByteRequest) else None
        if cache_key is not None and (cached := self._cache.get(cache_key)) is not None:
            return cached
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return run(self.get(key, default_buffer_prototype(), byte_range))
        try:
            size = os.fstat(fd).st_size
            if isinstance(byte_range, SuffixByteRequest):
                start, stop = max(0, size - byte_range.suffix), size
            elif isinstance(byte_range, RangeByteRequest):
                start, stop = byte_range.start, min(byte_range.end, size)
            elif isinstance(byte_range, OffsetByteRequest):
                start, stop = byte_range.offset, size
            else:
                start, stop = 0, size
            data = os.pread(fd, max(0, stop - start), start)
        finally:
            os.close(fd)
        result = default_buffer_prototype().buffer.from_bytes(data)
        if cache_key is not None:
            self._cache.put(cache_key, result)
        self.stats.add(len(result))
        return result
