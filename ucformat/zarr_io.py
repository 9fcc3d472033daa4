"""The only module that talks to zarr: stores, array creation, region writes and box reads.

Every array uses the same codec chain, declared once in :func:`codec_chain`: the
``sharding_indexed`` codec, whose inner chunks are little-endian ``bytes`` (optionally ``zstd``)
followed by a ``crc32c`` checksum, and whose shard index is ``bytes`` + ``crc32c`` at the end of
each shard. ``write_empty_chunks`` is on, so every shard of a complete store exists and a missing
one is a loss, never a silent fill value.

Reads go through :class:`CheckedStore`, which counts the bytes and requests a reader makes and
turns a missing data object into :class:`~ucformat.errors.ChunkMissingError`.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.abc.store import ByteRequest, Store
from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from ucformat.dtypes import numpy_storage_dtype
from ucformat.errors import ChunkMissingError, CorruptDataError, SourceNotFoundError
from ucformat.models import ArrayRef

__all__ = [
    "CheckedStore",
    "IOStats",
    "StoreLike",
    "create_array",
    "delete_key",
    "list_keys",
    "open_array",
    "open_store",
    "read_box",
    "read_key",
    "write_key",
    "write_region",
]

StoreLike = str | Path | Store


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


class CheckedStore(WrapperStore[Store]):
    """A store wrapper that counts reads and refuses missing data objects."""

    def __init__(self, store: Store, stats: IOStats | None = None) -> None:
        super().__init__(store)
        self.stats = stats if stats is not None else IOStats()

    def _with_store(self, store: Store) -> CheckedStore:
        return CheckedStore(store, self.stats)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        result = await self._store.get(key, prototype, byte_range)
        if result is None:
            if "/c/" in key or key.split("/")[-1] == "c":
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


def open_store(target: StoreLike, *, read_only: bool) -> Store:
    """Turn a path, an fsspec URL or a zarr store into a zarr store.

    Raises:
        SourceNotFoundError: a local path opened read-only does not exist.
    """
    if isinstance(target, Store):
        return (
            target
            if target.read_only == read_only or not read_only
            else target.with_read_only(True)
        )
    text = str(target)
    if "://" in text and not text.startswith("file://"):
        return FsspecStore.from_url(text, read_only=read_only)
    path = Path(text.removeprefix("file://"))
    if read_only and not path.exists():
        raise SourceNotFoundError(f"{path}: no such store.")
    return LocalStore(path, read_only=read_only)


def codec_chain(compressor: str) -> list[Any]:
    """The inner-chunk bytes-to-bytes codecs: optional zstd, then a crc32c checksum."""
    codecs: list[Any] = [ZstdCodec(level=3)] if compressor == "zstd" else []
    return [*codecs, Crc32cCodec()]


def create_array(store: Store, ref: ArrayRef) -> zarr.Array[Any]:
    """Create the (empty) zarr array described by ``ref``; write no chunks."""
    storage_dtype = numpy_storage_dtype(ref.dtype)
    common: dict[str, Any] = {
        "name": ref.path,
        "shape": tuple(ref.shape),
        "dtype": storage_dtype,
        "fill_value": 0,
        "filters": None,
        "compressors": codec_chain(ref.compressor),
        "serializer": BytesCodec(endian="little") if storage_dtype.itemsize > 1 else BytesCodec(),
        "attributes": {"ucformat": {"dtype": ref.dtype}},
        "config": {"write_empty_chunks": True},
        "zarr_format": 3,
        "overwrite": True,
    }
    if ref.shape:
        common["chunks"] = tuple(ref.chunk_shape)
        common["shards"] = tuple(ref.shard_shape)
    else:
        common["chunks"] = ()
    return zarr.create_array(store, **common)


def open_array(store: Store, path: str) -> zarr.Array[Any]:
    """Open an existing array without any zarr v2 probing."""
    try:
        return zarr.open_array(store, path=path, mode="r", zarr_format=3)
    except FileNotFoundError:
        raise ChunkMissingError(
            f"{path}: the array's metadata (zarr.json) is missing from the store."
        ) from None


def write_region(array: zarr.Array[Any], region: tuple[slice, ...], data: np.ndarray) -> None:
    """Write ``data`` (already in storage dtype and region shape) to ``array[region]``."""
    array[region] = data


def read_box(array: zarr.Array[Any], box: tuple[slice, ...]) -> np.ndarray:
    """Read ``array[box]``; a failed checksum becomes :class:`CorruptDataError`."""
    try:
        return np.asarray(array[box])
    except ChunkMissingError:
        raise
    except (ValueError, RuntimeError) as exc:
        if "checksum" in str(exc).lower() or "decode" in str(exc).lower():
            raise CorruptDataError(
                f"{array.path}: stored bytes fail their crc32c checksum in "
                f"{_describe_box(box)}; the store is corrupt (run 'ucformat verify')."
            ) from None
        raise CorruptDataError(
            f"{array.path}: cannot decode {_describe_box(box)} ({type(exc).__name__}: {exc})."
        ) from None


def _describe_box(box: tuple[slice, ...]) -> str:
    if not box:
        return "the scalar chunk"
    return "elements [" + ", ".join(f"{s.start}:{s.stop}" for s in box) + "]"


def read_key(store: Store, key: str) -> bytes | None:
    """The whole object at ``key``, or None if absent."""
    result = sync(store.get(key, default_buffer_prototype()))
    return None if result is None else result.to_bytes()


def write_key(store: Store, key: str, data: bytes) -> None:
    """Write one object (atomically on local disk and object stores)."""
    sync(store.set(key, default_buffer_prototype().buffer.from_bytes(data)))


def delete_key(store: Store, key: str) -> None:
    """Delete one object if present."""
    if sync(store.exists(key)):
        sync(store.delete(key))


def list_keys(store: Store, prefix: str = "") -> list[str]:
    """Every key under ``prefix``."""

    async def collect(items: AsyncIterator[str]) -> list[str]:
        return [item async for item in items]

    return sync(collect(store.list_prefix(prefix)))
