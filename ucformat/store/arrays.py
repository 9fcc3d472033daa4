r"""zarr arrays: the codec chain, array creation, region and shard writes, box reads.

Arrays are :class:`~ucformat.format.stacks.StoredArray`\ s: a store's zarr arrays as stored (a
format-3.1 stack of logical arrays, or an older store's array of one), with their chunk key
separator. Every array uses the same codec chain, declared once in :func:`codec_chain`: the
``sharding_indexed`` codec, whose inner chunks are little-endian ``bytes`` (optionally ``zstd``)
followed by a ``crc32c`` checksum, and whose shard index is ``bytes`` + ``crc32c`` at the end of
each shard. ``write_empty_chunks`` is on, so every shard of a complete store exists and a missing
one is a loss, never a silent fill value.

Reads go through :class:`~ucformat.store.checked.CheckedStore`. A chunk that fails its checksum,
or array metadata that cannot be parsed, is a :class:`~ucformat.errors.CorruptDataError` naming
the array and the chunk: never data.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

import numpy as np
import zarr
from zarr.abc.store import Store
from zarr.buffer import default_buffer_prototype
from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec
from zarr.storage import MemoryStore, StorePath

from ucformat.errors import ChunkMissingError, CorruptDataError
from ucformat.format.dtypes import numpy_storage_dtype
from ucformat.format.stacks import StoredArray
from ucformat.layout.grid import chunk_box, chunk_flat_range, chunks_in_box
from ucformat.store.direct.objects import local_object, local_object_root
from ucformat.store.keys import read_key, run, store_writes
from ucformat.sysio.fileio import pwrite_all

__all__ = [
    "Array",
    "BadChunk",
    "array_from_manifest",
    "bad_chunks",
    "chunk_key",
    "codec_chain",
    "create_array",
    "create_arrays",
    "create_root_group",
    "metadata_documents",
    "write_objects",
    "expected_metadata",
    "open_array",
    "read_box",
    "write_region",
    "write_shard",
]


#: Threads :func:`write_objects` creates a local store's small objects from.
OBJECT_WRITERS = 8

#: A zarr array, as the rest of ucformat names it (it never imports zarr itself).
Array: TypeAlias = "zarr.Array[Any]"


def create_root_group(store: Store, attributes: dict[str, Any]) -> None:
    """Write the store's root group (its ``zarr.json``) with ``attributes``, replacing any."""
    zarr.create_group(store, overwrite=True, zarr_format=3, attributes=attributes)


def codec_chain(compressor: str) -> list[Any]:
    """The inner-chunk bytes-to-bytes codecs: optional zstd, then a crc32c checksum."""
    codecs: list[Any] = [ZstdCodec(level=3)] if compressor == "zstd" else []
    return [*codecs, Crc32cCodec()]


def create_array(store: Store, ref: StoredArray) -> zarr.Array[Any]:
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
        "chunk_key_encoding": {"name": "default", "separator": ref.separator},
        "zarr_format": 3,
        "overwrite": True,
    }
    if ref.shape:
        common["chunks"] = tuple(ref.chunk_shape)
        common["shards"] = tuple(ref.shard_shape)
    else:
        common["chunks"] = ()
    return zarr.create_array(store, **common)


def create_arrays(store: Store, refs: Sequence[StoredArray]) -> list[zarr.Array[Any]]:
    """Create every array of ``refs`` at once (:func:`metadata_documents`, written by
    :func:`write_objects`); write no chunks."""
    write_objects(store, metadata_documents(refs))
    return [array_from_manifest(store, ref) for ref in refs]


def metadata_documents(refs: Sequence[StoredArray]) -> dict[str, bytes]:
    """Key -> bytes of the metadata objects of the arrays ``refs``: the same objects as
    :func:`create_array` writes for each (the array's ``zarr.json`` and those of its missing
    parent groups)."""
    documents: dict[str, bytes] = {}
    for ref in refs:
        parts = ref.path.split("/")
        for depth in range(1, len(parts)):
            documents.setdefault("/".join(parts[:depth]) + "/zarr.json", _group_document())
    for ref in refs:
        documents[f"{ref.path}/zarr.json"] = _expected_document(ref).encode()
    return documents


def write_objects(store: Store, objects: dict[str, bytes]) -> None:
    """Store small ``objects`` (key -> bytes).

    A local store gets them from :data:`OBJECT_WRITERS` threads, each object through a file
    renamed into place as zarr's ``LocalStore.set`` writes it (no event-loop round per object;
    the threads overlap the file system's latency: a file creation waits milliseconds for the
    journal on a busy disk); any other store gets them concurrently in one event-loop round.
    """

    def put(item: tuple[str, bytes]) -> None:
        with local_object(store, item[0]) as fd:
            assert fd is not None  # a writable local store: local_object_root said so
            pwrite_all(fd, memoryview(item[1]), 0)

    with store_writes(store, "writing the array metadata"):
        if local_object_root(store) is not None:
            with ThreadPoolExecutor(max_workers=OBJECT_WRITERS) as pool:
                list(pool.map(put, objects.items()))
            return
        prototype = default_buffer_prototype()

        async def write_all() -> None:
            results = await asyncio.gather(
                *(store.set(key, prototype.buffer.from_bytes(data))
                  for key, data in objects.items()),
                return_exceptions=True,  # every write finishes before a failure is raised
            )  # fmt: skip
            for result in results:
                if isinstance(result, BaseException):
                    raise result

        run(write_all())


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
def _expected_document(ref: StoredArray) -> str:
    """The ``zarr.json`` of ``ref``'s layout (the path plays no part in it)."""
    if ref.path != "a":
        return _expected_document(replace(ref, path="a"))
    store = MemoryStore()
    create_array(store, ref)
    document = read_key(store, "a/zarr.json")
    if document is None:
        raise RuntimeError("zarr wrote no array metadata")
    return document.decode()


def expected_metadata(ref: StoredArray) -> dict[str, Any]:
    """The ``zarr.json`` document :func:`create_array` writes for ``ref``, parsed."""
    document: dict[str, Any] = json.loads(_expected_document(ref))
    return document


def array_from_manifest(store: Store, ref: StoredArray) -> zarr.Array[Any]:
    """The array described by ``ref``, opened without reading its ``zarr.json``."""
    metadata = _metadata(replace(ref, path="a"))
    return zarr.Array(zarr.AsyncArray(metadata=metadata, store_path=StorePath(store, ref.path)))


@functools.lru_cache(maxsize=256)
def _metadata(ref: StoredArray) -> Any:
    """Parsed array metadata, shared by the arrays of one layout (it is immutable): parsing it
    costs milliseconds, and a model repeats a few layouts over hundreds of arrays. Taken from
    an array built once in memory (public ``Array.metadata``), not from zarr's private parser."""
    document = json.loads(_expected_document(ref))
    return zarr.Array.from_dict(StorePath(MemoryStore(), "a"), document).metadata


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
        run(array.store_path.store.set(key, buffer))


def read_box(array: zarr.Array[Any], box: tuple[slice, ...], what: str = "") -> np.ndarray:
    """Read ``array[box]``, every chunk checksum verified; ``what`` names the array in messages
    (default: its path).

    Raises:
        ChunkMissingError: an object of the box is missing.
        CorruptDataError: a chunk fails its checksum or cannot be decoded; the message names
            the array, the first bad chunk's grid coordinates and its flat element range.
    """
    what = what or array.path
    try:
        with _damage_quiet():
            return np.asarray(array[box])
    except ChunkMissingError:
        raise
    except (ValueError, RuntimeError) as exc:
        first = next(bad_chunks(array, box), None)
        if first is None:  # no single chunk fails alone: describe the read
            where = "the scalar chunk" if not box else f"elements {_describe_box(box)}"
            raise CorruptDataError(
                f"{what}: cannot decode {where} ({_reason(exc)}); the store is corrupt "
                "(run 'ucformat verify')."
            ) from None
        raise CorruptDataError(
            f"{what}: {first.describe()} {first.reason}; the store is corrupt, no values "
            "were returned (run 'ucformat verify' for a full report)."
        ) from None


@contextlib.contextmanager
def _damage_quiet() -> Iterator[None]:
    """No numpy overflow warnings while zarr decodes a shard: a damaged or hostile index
    (an offset + length past 2**64) makes zarr's sharding codec add uint64 scalars that wrap,
    which numpy reports on stderr before the read fails; the failure is reported, in one line,
    by the caller. (The warning is raised on zarr's event-loop thread, so the process-wide
    filter is what reaches it, not ``np.errstate``.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
        yield


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
            with _damage_quiet():
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
