"""A store and its objects by key: open a store, read, write, delete and list whole objects.

Thin wrappers over zarr's public ``Store`` API (run synchronously), used for the manifest, array
metadata and cleanup. ``write_empty_chunks`` is on for every array (:mod:`ucformat.store.arrays`),
so a missing data object is a loss, never a silent fill value.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from zarr.abc.store import Store
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from ucformat.errors import StoreAccessError, StoreWriteError, UCFormatError
from ucformat.store.locations import existing_store_directory, local_directory

__all__ = [
    "StoreLike",
    "delete_key",
    "describe_store",
    "list_keys",
    "open_store",
    "read_key",
    "store_writes",
    "write_key",
]

StoreLike = str | Path | Store


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
