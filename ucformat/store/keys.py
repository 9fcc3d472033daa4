"""A store and its objects by key: open a store, read, write, delete and list whole objects.

Thin wrappers over zarr's public ``Store`` API (run synchronously), used for the manifest, array
metadata and cleanup. ``write_empty_chunks`` is on for every array (:mod:`ucformat.store.arrays`),
so a missing data object is a loss, never a silent fill value.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from zarr.abc.store import Store
from zarr.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from ucformat.errors import StoreAccessError, StoreWriteError, UCFormatError
from ucformat.store.locations import existing_store_directory, local_directory
from ucformat.store.staged_local import StagedLocalStore

__all__ = [
    "Store",
    "StoreLike",
    "delete_key",
    "list_keys",
    "local_root",
    "open_store",
    "read_key",
    "run",
    "describe_store",
    "store_writes",
    "write_key",
]

#: What every public entry point accepts as a store.
StoreLike = str | Path | Store

_T = TypeVar("_T")


def run(coroutine: Coroutine[Any, Any, _T]) -> _T:
    """Run one of zarr's store coroutines to completion on zarr's own event loop.

    The one use of ``zarr.core.sync``: zarr 3.1 has no public synchronous store API, and store
    calls must run on the loop ``zarr.Array`` uses (an fsspec store is bound to it).
    """
    return sync(coroutine)


def local_root(store: Store) -> Path | None:
    """The directory of a local directory store, else None (object stores, memory)."""
    return Path(store.root) if isinstance(store, LocalStore) else None


def open_store(target: StoreLike, *, read_only: bool) -> Store:
    """Turn a path, an fsspec URL or a zarr store into a zarr store.

    A local directory opened for writing is a :class:`StagedLocalStore`: the write goes to a
    staging folder beside the destination and is swapped into place at the commit.

    Raises:
        SourceNotFoundError: a local path opened read-only does not exist.
        NotAStoreError: a local path opened read-only is a file.
    """
    if type(target) is LocalStore and not read_only:
        return StagedLocalStore(target.root)
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
        return LocalStore(path, read_only=True)
    return StagedLocalStore(path)


def describe_store(store: Store) -> str:
    """Where ``store`` is, for messages: its URL (``s3://bucket/prefix``) or local root."""
    while isinstance(store, WrapperStore):
        store = store._store
    if isinstance(store, StagedLocalStore):
        return str(store.destination)
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
    except Exception as exc:
        if not isinstance(exc, OSError) and not _is_transport_error(exc):
            raise
        reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
        reason = reason or type(exc).__name__
        raise StoreWriteError(
            f"{describe_store(store)}: {what} failed ({type(exc).__name__}: "
            f"{reason[:200]}); nothing was committed. {_write_hint(store, exc)}"
        ) from None


def _is_transport_error(exc: BaseException) -> bool:
    """An object store's client error that is no ``OSError`` (botocore's
    ``EndpointConnectionError`` for an unreachable or stopped server, ...)."""
    return any(
        kind.__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp")
        for kind in type(exc).__mro__
    )


def _write_hint(store: Store, exc: Exception) -> str:
    """What to do about a failed write, by its cause."""
    local = isinstance(store, LocalStore)
    if not isinstance(exc, OSError):
        return (
            "The object store did not answer (endpoint, network, server): check it, then "
            "re-run with overwrite=True."
        )
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM) or isinstance(exc, PermissionError):
        if local:
            return (
                "The destination (or its parent folder, which holds the staging folder and the "
                "lock) is not writable: choose a writable destination."
            )
        return "Check the bucket's permissions and the credentials, then re-run."
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "The disk is full: free some space, then re-run."
    if local:
        return "Check the destination folder, then re-run."
    return "Check the destination (bucket, credentials, endpoint), then re-run with overwrite=True."


def read_key(store: Store, key: str) -> bytes | None:
    """The whole object at ``key``, or None if absent."""
    result = run(store.get(key, default_buffer_prototype()))
    return None if result is None else result.to_bytes()


def write_key(store: Store, key: str, data: bytes) -> None:
    """Write one object (atomically on local disk and object stores)."""
    with store_writes(store, f"writing {key}"):
        run(store.set(key, default_buffer_prototype().buffer.from_bytes(data)))


def delete_key(store: Store, key: str) -> None:
    """Delete one object if present."""
    with store_writes(store, f"deleting {key}"):
        if run(store.exists(key)):
            run(store.delete(key))


def list_keys(store: Store, prefix: str = "") -> list[str]:
    """Every key under ``prefix``."""

    async def collect(items: AsyncIterator[str]) -> list[str]:
        return [item async for item in items]

    return run(collect(store.list_prefix(prefix)))
