"""The only module that talks to zarr: stores, array creation, region writes and box reads.

Every array uses the same codec chain, declared once in :func:`codec_chain`: the
``sharding_indexed`` codec, whose inner chunks are little-endian ``bytes`` (optionally ``zstd``)
followed by a ``crc32c`` checksum, and whose shard index is ``bytes`` + ``crc32c`` at the end of
each shard. ``write_empty_chunks`` is on, so every shard of a complete store exists and a missing
one is a loss, never a silent fill value.

Reads go through :class:`CheckedStore`, which counts the bytes and requests a reader makes and
turns a missing data object into :class:`~ucformat.errors.ChunkMissingError`. A chunk that fails
its checksum, or array metadata that cannot be parsed, is a
:class:`~ucformat.errors.CorruptDataError` naming the array and the chunk: never data.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec
from zarr.core.array import AsyncArray
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.core.metadata.v3 import ArrayV3Metadata
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore, MemoryStore, StorePath, WrapperStore

from ucformat.dtypes import numpy_storage_dtype
from ucformat.errors import (
    ChunkMissingError,
    CorruptDataError,
    StoreAccessError,
    StoreWriteError,
    UCFormatError,
)
from ucformat.layout.grid import chunk_box, chunk_flat_range, chunks_in_box
from ucformat.locations import existing_store_directory, local_directory
from ucformat.models import ArrayRef

__all__ = [
    "BadChunk",
    "CheckedStore",
    "IOStats",
    "StoreLike",
    "bad_chunks",
    "chunk_key",
    "array_from_manifest",
    "create_array",
    "create_arrays",
    "delete_key",
    "describe_store",
    "expected_metadata",
    "fetch_bytes",
    "list_keys",
    "local_file",
    "local_object",
    "open_array",
    "open_store",
    "read_box",
    "read_key",
    "store_writes",
    "write_key",
    "write_region",
    "write_shard",
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
            name = key.rpartition("/")[2]  # a param named "c" has metadata under ".../c/..."
            if name != "zarr.json" and ("/c/" in key or name == "c"):
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
            return sync(self.get(key, default_buffer_prototype(), byte_range))
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


def open_store(target: StoreLike, *, read_only: bool) -> Store:
    """Turn a path, an fsspec URL or a zarr store into a zarr store.

    Raises:
        SourceNotFoundError: a local path opened read-only does not exist.
        NotAStoreError: a local path opened read-only is a file.
    """
    if isinstance(target, Store):
        return (
            target
            if target.read_only == read_only or not read_only
            else target.with_read_only(True)
        )
    path = local_directory(target)
    if path is None:
        try:
            return FsspecStore.from_url(str(target), read_only=read_only)
        except (ImportError, ValueError) as exc:  # unknown protocol, backend not installed
            raise StoreAccessError(
                f"{target}: cannot open this URL ({exc}); install the fsspec backend for its "
                "protocol (e.g. s3fs, gcsfs, adlfs) or give a local path."
            ) from None
    if read_only:
        existing_store_directory(path)
    return LocalStore(path, read_only=read_only)


def describe_store(store: Store) -> str:
    """Where ``store`` is, for messages: its URL (``s3://bucket/prefix``) or local root."""
    while isinstance(store, WrapperStore):
        store = store._store
    if isinstance(store, LocalStore):
        return str(store.root)
    if isinstance(store, FsspecStore):
        protocol = store.fs.protocol
        scheme = protocol[0] if isinstance(protocol, tuple | list) else protocol
        return f"{scheme}://{store.path}"
    return str(store)


@contextlib.contextmanager
def store_writes(store: Store, what: str) -> Iterator[None]:
    """Turn an ``OSError`` of a store while ``what`` (``"writing <key>"``) into one
    :class:`StoreWriteError`.

    Object stores report a refused PUT (no bucket, no permission, server gone) as an
    ``OSError`` subclass through fsspec; local stores a full disk or a read-only folder.
    """
    try:
        yield
    except UCFormatError:
        raise
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise StoreWriteError(
            f"{describe_store(store)}: {what} failed ({type(exc).__name__}: "
            f"{reason[:200]}); nothing was committed. Check the destination (bucket, "
            "credentials, endpoint, free space) and re-run with --overwrite."
        ) from None


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


def create_arrays(store: Store, refs: Sequence[ArrayRef]) -> list[zarr.Array[Any]]:
    """Create every array of ``refs`` at once; write no chunks.

    The same objects as :func:`create_array` for each (the array's ``zarr.json`` and those of
    its missing parent groups), written concurrently in one event-loop round instead of one
    ``create_array`` round trip per array.
    """
    documents: dict[str, bytes] = {}
    for ref in refs:
        parts = ref.path.split("/")
        for depth in range(1, len(parts)):
            documents.setdefault("/".join(parts[:depth]) + "/zarr.json", _group_document())
    for ref in refs:
        documents[f"{ref.path}/zarr.json"] = _expected_document(
            ref.dtype, tuple(ref.shape), tuple(ref.chunk_shape), tuple(ref.shard_shape),
            ref.compressor,
        ).encode()  # fmt: skip
    prototype = default_buffer_prototype()

    async def write_all() -> None:
        results = await asyncio.gather(
            *(store.set(key, prototype.buffer.from_bytes(data)) for key, data in documents.items()),
            return_exceptions=True,  # every write finishes before a failure is raised
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    with store_writes(store, "writing the array metadata"):
        sync(write_all())
    return [array_from_manifest(store, ref) for ref in refs]


@functools.lru_cache(maxsize=1)
def _group_document() -> bytes:
    """The ``zarr.json`` zarr writes for an implicit parent group."""
    store = MemoryStore()
    zarr.create_group(store, path="g", zarr_format=3)
    document = read_key(store, "g/zarr.json")
    if document is None:
        raise RuntimeError("zarr wrote no group metadata")
    return document


def open_array(store: Store, path: str) -> zarr.Array[Any]:
    """Open an existing array from its own ``zarr.json``, without any zarr v2 probing.

    Raises:
        ChunkMissingError: the array's ``zarr.json`` is missing.
        CorruptDataError: the ``zarr.json`` cannot be parsed.
    """
    try:
        return zarr.open_array(store, path=path, mode="r", zarr_format=3)
    except ChunkMissingError:
        raise
    except FileNotFoundError:
        raise ChunkMissingError(
            f"{path}: the array's metadata (zarr.json) is missing from the store."
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptDataError(
            f"{path}/zarr.json: the array's metadata is damaged ({type(exc).__name__}: "
            f"{str(exc)[:200]}); the store is corrupt (run 'ucformat verify')."
        ) from None


@functools.lru_cache(maxsize=256)
def _expected_document(
    dtype: str, shape: tuple[int, ...], chunk: tuple[int, ...], shard: tuple[int, ...], comp: str
) -> str:
    store = MemoryStore()
    ref = ArrayRef(
        path="a", dtype=dtype, shape=list(shape), chunk_shape=list(chunk),  # type: ignore[arg-type]
        shard_shape=list(shard), nbytes=0, compressor=comp,  # type: ignore[arg-type]
    )  # fmt: skip
    create_array(store, ref)
    document = read_key(store, "a/zarr.json")
    if document is None:
        raise RuntimeError("zarr wrote no array metadata")
    return document.decode()


def expected_metadata(ref: ArrayRef) -> dict[str, Any]:
    """The ``zarr.json`` document :func:`create_array` writes for ``ref``, parsed."""
    text = _expected_document(
        ref.dtype, tuple(ref.shape), tuple(ref.chunk_shape), tuple(ref.shard_shape), ref.compressor
    )
    document: dict[str, Any] = json.loads(text)
    return document


def array_from_manifest(store: Store, ref: ArrayRef) -> zarr.Array[Any]:
    """The array described by ``ref``, opened without reading its ``zarr.json``."""
    metadata = ArrayV3Metadata.from_dict(expected_metadata(ref))
    return zarr.Array(AsyncArray(metadata=metadata, store_path=StorePath(store, ref.path)))


def chunk_key(array: zarr.Array[Any], coords: tuple[int, ...]) -> str:
    """The store key of the object holding chunk (or, sharded, shard) ``coords``."""
    return f"{array.path}/{array.metadata.encode_chunk_key(coords)}"


def write_region(array: zarr.Array[Any], region: tuple[slice, ...], data: np.ndarray) -> None:
    """Write ``data`` (already in storage dtype and region shape) to ``array[region]``."""
    with store_writes(array.store_path.store, f"writing {array.path}"):
        array[region] = data


def write_shard(array: zarr.Array[Any], shard: tuple[int, ...], data: np.ndarray) -> None:
    """Store ``data`` (``uint8``, an encoded shard object) as shard ``shard`` of ``array``."""
    buffer = default_buffer_prototype().buffer.from_array_like(data)
    key = chunk_key(array, shard)
    with store_writes(array.store_path.store, f"writing {key}"):
        sync(array.store_path.store.set(key, buffer))


def read_box(array: zarr.Array[Any], box: tuple[slice, ...]) -> np.ndarray:
    """Read ``array[box]``, every chunk checksum verified.

    Raises:
        ChunkMissingError: an object of the box is missing.
        CorruptDataError: a chunk fails its checksum or cannot be decoded; the message names
            the array, the first bad chunk's grid coordinates and its flat element range.
    """
    try:
        return np.asarray(array[box])
    except ChunkMissingError:
        raise
    except (ValueError, RuntimeError) as exc:
        first = next(bad_chunks(array, box), None)
        if first is None:  # no single chunk fails alone: describe the read
            where = "the scalar chunk" if not box else f"elements {_describe_box(box)}"
            raise CorruptDataError(
                f"{array.path}: cannot decode {where} ({_reason(exc)}); the store is corrupt "
                "(run 'ucformat verify')."
            ) from None
        raise CorruptDataError(
            f"{array.path}: {first.describe()} {first.reason}; the store is corrupt, no values "
            "were returned (run 'ucformat verify' for a full report)."
        ) from None


@dataclass(frozen=True)
class BadChunk:
    """A chunk that cannot be read back: grid coordinates, flat element range and why."""

    coords: tuple[int, ...]
    start: int
    stop: int
    reason: str

    def describe(self) -> str:
        """``chunk (3, 0) (elements [48, 64))``."""
        coords = "(" + ", ".join(map(str, self.coords)) + ")"
        return f"chunk {coords} (elements [{self.start}, {self.stop}))"


def bad_chunks(array: zarr.Array[Any], box: tuple[slice, ...]) -> Iterator[BadChunk]:
    """Read every chunk of ``box`` on its own and yield those that fail their checksum."""
    shape, chunks = tuple(array.shape), tuple(array.chunks)
    for coords in chunks_in_box(shape, chunks, box):
        try:
            np.asarray(array[chunk_box(shape, chunks, coords)])
        except ChunkMissingError:
            raise
        except (ValueError, RuntimeError) as exc:
            start, stop = chunk_flat_range(shape, chunks, coords)
            yield BadChunk(coords, start, stop, _reason(exc))


def _reason(exc: BaseException) -> str:
    if "checksum" in str(exc).lower():
        return "fails its crc32c checksum"
    return f"cannot be decoded ({type(exc).__name__}: {str(exc)[:200]})"


def _describe_box(box: tuple[slice, ...]) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in box) + "]"


def fetch_bytes(
    store: Store, key: str, start: int | None = None, stop: int | None = None,
    *, suffix: int | None = None,
) -> np.ndarray | None:  # fmt: skip
    """Bytes ``[start, stop)`` (or the last ``suffix`` bytes) of the object at ``key``, as
    ``uint8``; None if the object is absent. A :class:`CheckedStore` counts them, caches
    suffix reads (shard indexes) and raises :class:`ChunkMissingError` for a missing shard."""
    request: ByteRequest | None
    if suffix is not None:
        request = SuffixByteRequest(suffix)
    elif start is not None and stop is not None:
        request = RangeByteRequest(start, stop)
    else:
        request = None
    path = local_file(store, key) if isinstance(store, CheckedStore) else None
    if isinstance(store, CheckedStore) and path is not None:
        result = store.get_local(path, key, request)
    else:
        result = sync(store.get(key, default_buffer_prototype(), request))
    return None if result is None else result.as_numpy_array()


def local_file(store: Store, key: str) -> Path | None:
    """The file holding ``key`` if ``store`` is (a wrapper of) a local directory store."""
    while isinstance(store, WrapperStore):
        store = store._store
    return Path(store.root) / key if isinstance(store, LocalStore) else None


@contextlib.contextmanager
def local_object(store: Store, key: str) -> Iterator[int | None]:
    """A file descriptor open for writing the object ``key`` of a local store, else None.

    Written the way zarr's ``LocalStore.set`` writes: into ``<key>.<hex>.partial``, renamed over
    ``key`` when the block exits normally and removed if it raises, so a reader never sees a
    partial object under its real name.
    """
    path = local_file(store, key)
    if path is None or store.read_only:
        yield None
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{uuid.uuid4().hex}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        yield fd
    except BaseException:
        os.close(fd)
        partial.unlink(missing_ok=True)
        raise
    os.close(fd)
    partial.replace(path)


def read_key(store: Store, key: str) -> bytes | None:
    """The whole object at ``key``, or None if absent."""
    result = sync(store.get(key, default_buffer_prototype()))
    return None if result is None else result.to_bytes()


def write_key(store: Store, key: str, data: bytes) -> None:
    """Write one object (atomically on local disk and object stores)."""
    with store_writes(store, f"writing {key}"):
        sync(store.set(key, default_buffer_prototype().buffer.from_bytes(data)))


def delete_key(store: Store, key: str) -> None:
    """Delete one object if present."""
    with store_writes(store, f"deleting {key}"):
        if sync(store.exists(key)):
            sync(store.delete(key))


def list_keys(store: Store, prefix: str = "") -> list[str]:
    """Every key under ``prefix``."""

    async def collect(items: AsyncIterator[str]) -> list[str]:
        return [item async for item in items]

    return sync(collect(store.list_prefix(prefix)))
