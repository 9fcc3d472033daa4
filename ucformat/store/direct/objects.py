"""The objects of a store as bytes and local files: what the direct path reads and writes.

* :func:`fetch_bytes`: a byte range (or suffix) of one object, through :class:`CheckedStore`'s
  ``pread`` path on a local directory store, else through the store;
* :func:`local_file`: the file behind a key of a (wrapped) local directory store;
* :func:`local_object`: a file descriptor to write one object of a local store in place, committed
  by a rename exactly as zarr's ``LocalStore.set`` commits.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from zarr.abc.store import ByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.buffer import default_buffer_prototype

from ucformat.store.checked import CheckedStore
from ucformat.store.keys import local_root, run

__all__ = ["fetch_bytes", "local_file", "local_object", "local_object_root"]


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
        result = run(store.get(key, default_buffer_prototype(), request))
    return None if result is None else result.as_numpy_array()


def local_file(store: Store, key: str) -> Path | None:
    """The file holding ``key`` if ``store`` is (a :class:`CheckedStore` of) a local directory
    store."""
    root = local_root(store.wrapped if isinstance(store, CheckedStore) else store)
    return None if root is None else root / key


def local_object_root(store: Store) -> Path | None:
    """The folder :func:`local_object` writes ``store``'s objects into, or None if it writes
    none (not a local directory store, or read-only)."""
    return None if store.read_only else local_file(store, "")


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
