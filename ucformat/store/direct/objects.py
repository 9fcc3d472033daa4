"""The objects of a store as bytes and local files: what the direct path reads and writes.

* :func:`fetch_bytes`: a byte range (or suffix) of one object, through :class:`CheckedStore`'s
  ``pread`` path on a local directory store, else through the store;
* :func:`local_file`: the file behind a key of a (wrapped) local directory store;
* :func:`local_object`: a file descriptor to write one object of a local store in place, committed
  by a rename exactly as zarr's ``LocalStore.set`` commits;
* :func:`make_folders`: the folders a local store's objects will need, made ahead of them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from zarr.abc.store import ByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.buffer import default_buffer_prototype

from ucformat.store.checked import CheckedStore
from ucformat.store.keys import local_root, run
from ucformat.sysio.fileio import replacing

__all__ = ["fetch_bytes", "local_file", "local_object", "local_object_root", "make_folders"]


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


def make_folders(store: Store, keys: Iterable[str]) -> int:
    """Make every folder that the objects ``keys`` of a local store lie in, parents first;
    the number made (0 for other stores, which have no folders).

    A writer calls it before it writes any object: on ext4 (and other journalling file
    systems) a folder made while gigabytes of written data are being flushed waits for the
    journal, milliseconds each, where the same folders made beforehand take microseconds each
    (docs/benchmarks.md). Folders that exist already (made by another writer) are skipped.
    """
    root = local_object_root(store)
    if root is None:
        return 0
    folders: set[str] = set()
    for key in keys:
        folder = key.rpartition("/")[0]
        while folder and folder not in folders:
            folders.add(folder)
            folder = folder.rpartition("/")[0]
    made = 0
    for folder in sorted(folders, key=lambda name: (name.count("/"), name)):
        try:
            os.mkdir(root / folder)
        except FileExistsError:
            continue
        made += 1
    return made


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
    # its folder was usually made ahead (make_folders): no mkdir per object
    with replacing(path, make_folder=True) as fd:
        yield fd
