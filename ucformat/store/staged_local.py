"""A local store written beside its destination and swapped into place at the commit.

Every local write goes to the staging folder ``.<name>.ucformat-staging`` in the destination's
parent (docs/format.md §6.2); the commit renames it onto the destination, exchanging it
atomically with a previous store (Linux ``renameat2(RENAME_EXCHANGE)``; elsewhere two renames),
so that an earlier complete store stays complete and readable until the new one is committed.
The staging name is fixed by the destination, so every rank of a distributed write opens the
same folder; one writer at a time is enforced by :mod:`ucformat.store.writer_lock`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from zarr.storage import LocalStore

__all__ = ["StagedLocalStore", "in_place", "publish", "staging_path"]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def staging_path(destination: Path) -> Path:
    """Where a write to ``destination`` is staged."""
    destination = Path(os.path.abspath(destination))
    return destination.parent / f".{destination.name}.ucformat-staging"


def in_place(destination: Path) -> bool:
    """Whether a write to ``destination`` cannot be staged beside it (a mount point)."""
    return os.path.ismount(destination)


class StagedLocalStore(LocalStore):
    """A writable :class:`LocalStore` whose root is the staging folder of ``destination``.

    After :func:`publish`, ``root`` is the destination itself.
    """

    destination: Path

    def __init__(self, root: Path | str, *, read_only: bool = False) -> None:
        self.destination = Path(os.path.abspath(root))
        # A mount point cannot be renamed: it is written in place (uncommitted first, §6.2).
        staged = self.destination if in_place(self.destination) else staging_path(self.destination)
        super().__init__(staged, read_only=read_only)

    def with_read_only(self, read_only: bool = False) -> Any:
        """A plain local store at the current root (readers never see staging folders)."""
        return LocalStore(self.root, read_only=read_only)

    def __repr__(self) -> str:
        return f"StagedLocalStore({str(self.destination)!r})"


def publish(store: StagedLocalStore, *, durable: bool = True) -> None:
    """Move the staged store onto its destination (the commit point); remove the old store."""
    staged, destination = Path(store.root), store.destination
    if staged == destination:
        return  # already published
    old: Path | None = None
    if destination.is_dir() and any(destination.iterdir()):
        if _exchange(staged, destination):
            old = staged  # the previous store now lies at the staging path
        else:
            old = destination.with_name(f".{destination.name}.ucformat-old-{uuid.uuid4().hex}")
            os.rename(destination, old)
            os.rename(staged, destination)
    else:
        if destination.is_dir():
            destination.rmdir()
        os.rename(staged, destination)
    if durable:
        _fsync_dir(destination.parent)
    store.root = destination
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories; False if this system cannot."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
