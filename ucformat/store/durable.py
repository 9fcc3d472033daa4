"""Durability of a local store's commit (docs/format.md §6): fsync before and after the manifest.

Renaming the manifest into place makes the commit atomic, but not durable: after a power loss
the file system may have kept the rename and lost shard data written before it. So, on a local
directory store, :func:`sync_tree` flushes every file and then every directory of the store
(deepest first: a directory's entries, i.e. the renames that named its files, are durable once
the directory is fsynced), and :func:`write_file_atomic` writes the manifest to a temporary
file, fsyncs it, renames it over its name and fsyncs the directory.

A distributed write splits the first step among its writers (docs/format.md §6,
"Durability"): each one flushes, with :func:`sync_written`, the objects it wrote and every
directory above them before the ranks agree, so the committer then only writes the manifest
durably.

Object stores need none of this (a successful PUT is durable and atomic); other stores get
what their backend gives.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ucformat.sysio.fileio import pwrite_all, replacing

__all__ = ["SyncStats", "fsync_path", "sync_tree", "sync_written", "write_file_atomic"]

#: fsync calls in flight at once (each releases the GIL; the disk queues them).
SYNC_WORKERS = 8


@dataclass(frozen=True)
class SyncStats:
    """What :func:`sync_tree` flushed."""

    files: int
    directories: int


def fsync_path(path: Path, *, directory: bool = False) -> None:
    """``fsync`` the file or directory at ``path``."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: Path, *, workers: int = SYNC_WORKERS) -> SyncStats:
    """fsync every regular file under ``root``, then every directory, deepest first, root last."""
    files: list[Path] = []
    directories: list[Path] = []
    for folder, _, names in os.walk(root, topdown=False):  # children before their parent
        base = Path(folder)
        files.extend(base / name for name in names if (base / name).is_file())
        directories.append(base)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(fsync_path, files))
    for directory in directories:  # in order: a parent after all its children
        fsync_path(directory, directory=True)
    return SyncStats(len(files), len(directories))


def sync_written(root: Path, keys: Iterable[str], *, workers: int = SYNC_WORKERS) -> SyncStats:
    """fsync the objects ``keys`` under ``root`` that exist, and every directory above them.

    What one writer of a distributed write calls for the objects it wrote, once they are all
    written: each file, then every directory from the file's parent up to ``root`` (included),
    each once. A directory fsync makes the entries it holds at that moment durable, so every
    entry this writer created (its files, and the directories made for them) is durable on
    return, whatever the other writers are doing meanwhile. Keys whose file is absent (nothing
    was written) are skipped.
    """
    files: list[Path] = []
    directories: set[Path] = set()
    for key in keys:
        path = root / key
        if not path.is_file():
            continue
        files.append(path)
        parent = path.parent
        while parent not in directories:
            directories.add(parent)
            if parent == root or root not in parent.parents:
                break
            parent = parent.parent
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(fsync_path, files))  # files first: then the entries naming them
        list(pool.map(lambda d: fsync_path(d, directory=True), sorted(directories, reverse=True)))
    return SyncStats(len(files), len(directories))


def write_file_atomic(path: Path, data: bytes, *, fsync: bool) -> None:
    """Write ``data`` to ``path`` atomically (:func:`~ucformat.sysio.fileio.replacing`); with
    ``fsync``, also durably (the file fsynced before the rename, the directory after)."""
    with replacing(path) as fd:
        pwrite_all(fd, memoryview(data), 0)
        if fsync:
            os.fsync(fd)
    if fsync:
        fsync_path(path.parent, directory=True)
