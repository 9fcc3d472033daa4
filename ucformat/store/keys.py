"""A store and its objects by key: open a store, read, write, delete and list whole objects.

Thin wrappers over zarr's public ``Store`` API (run synchronously), used for the manifest, array
metadata and cleanup. ``write_empty_chunks`` is on for every array (:mod:`ucformat.store.arrays`),
so a missing data object is a loss, never a silent fill value.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from zarr.abc.store import Store
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore

from ucformat.errors import StoreAccessError
from ucformat.store.locations import existing_store_directory, local_directory

__all__ = ["StoreLike", "delete_key", "list_keys", "open_store", "read_key", "write_key"]

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
