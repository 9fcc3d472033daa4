"""Take and give back the writer lock of a store that is not staged locally (docs/format.md §6.3).

An object store's lock object (a conditional PUT on S3), or the lock beside a plain local
store; a staged local store's lock is taken and released by its
:class:`~ucformat.store.destination.LocalDestination`. :func:`acquire_writer` runs before a
writer touches the destination (:func:`ucformat.store.lifecycle.start_store`);
:func:`release_writer` after the commit (:func:`ucformat.store.manifest_io.commit_manifest`)
or the discard of a failed write.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from zarr.abc.store import Store
from zarr.storage import FsspecStore, LocalStore

from ucformat.errors import StoreBusyError
from ucformat.store.keys import delete_key, describe_store, read_key, run, write_key
from ucformat.store.staged_local import StagedLocalStore
from ucformat.store.writer_lock import (
    LOCK_KEY,
    acquire_local,
    busy_message,
    lock_payload,
    parse_lock,
    release_local,
)

__all__ = ["acquire_writer", "destination_root", "release_writer"]

_HELD_OBJECTS: set[str] = set()


def destination_root(store: Store) -> Path | None:
    """The local destination folder of a writable local store (staged or not), else None."""
    if isinstance(store, StagedLocalStore):
        return store.destination
    if isinstance(store, LocalStore):
        return Path(store.root)
    return None


def acquire_writer(store: Store) -> None:
    """Take the destination's lock.

    Raises:
        StoreBusyError: another writer holds it (one line naming the holder).
        OSError: the lock cannot be created (turned into a ``StoreWriteError`` by the caller).
    """
    root = destination_root(store)
    if root is not None:
        acquire_local(root)
        return
    where = describe_store(store)
    payload = lock_payload()
    for _ in range(2):
        if _create_object(store, payload):
            _HELD_OBJECTS.add(where)
            return
        data = read_key(store, LOCK_KEY)
        holder = None if data is None else parse_lock(data)
        if data is not None and (holder is None or not holder.is_stale()):
            raise StoreBusyError(busy_message(where, f"{where}/{LOCK_KEY}", holder))
        delete_key(store, LOCK_KEY)  # stale: its writer's process is gone
    raise StoreBusyError(busy_message(where, f"{where}/{LOCK_KEY}", None))


def release_writer(store: Store) -> None:
    """Give the lock back if this process holds it (idempotent; never raises for a lock that
    is already gone)."""
    root = destination_root(store)
    if root is not None:
        release_local(root)
        return
    where = describe_store(store)
    if where in _HELD_OBJECTS:
        _HELD_OBJECTS.discard(where)
        with contextlib.suppress(Exception):
            delete_key(store, LOCK_KEY)


def _create_object(store: Store, payload: bytes) -> bool:
    """Create the lock object if absent; False if it exists. Atomic on S3 (conditional PUT)."""
    fs: Any = getattr(store, "fs", None)
    if isinstance(store, FsspecStore) and type(fs).__name__ == "S3FileSystem":
        path = f"{store.path}/{LOCK_KEY}"
        try:
            run(fs._pipe_file(path, payload, mode="create"))  # If-None-Match: *
        except (FileExistsError, OSError) as exc:
            if isinstance(exc, FileExistsError) or read_key(store, LOCK_KEY) is not None:
                return False
            raise
        return True
    if read_key(store, LOCK_KEY) is not None:  # other object stores: check, then put
        return False
    write_key(store, LOCK_KEY, payload)
    return True
