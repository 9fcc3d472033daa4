"""One lifecycle for every local folder a writer fills: stores and exports alike.

A writer never writes into its destination folder ``D`` itself (docs/format.md §6.2, §6.3).
Every local writer, the store writers (convert, live saves, distributed convert) and every
export, goes through a :class:`LocalDestination`:

1. :meth:`~LocalDestination.start`: take ``D``'s writer lock (:mod:`ucformat.store.writer_lock`),
   let the writer check ``D`` (its own rule: a store replaces a store, an export its own files),
   remove what a killed writer left, and create the staging folder ``.<name>.ucformat-staging``
   beside ``D`` (same parent: same file system, so the commit is a rename).
2. The writer fills :attr:`~LocalDestination.staging`, and nothing else.
3. :meth:`~LocalDestination.commit`: with ``fsync``, every file and directory of the staging
   folder is made durable (:func:`ucformat.store.durable.sync_tree`; skipped when the writers
   did it themselves), then, with Ctrl-C held back (:mod:`ucformat.sysio.interrupts`) so that
   it happens entirely or not at all, the writer's seal (a store's manifest) and the swap: when
   ``D`` is missing, empty or holds only entries the write replaces, the staging folder is
   renamed onto ``D``, exchanged atomically with a previous ``D`` (Linux
   ``renameat2(RENAME_EXCHANGE)``; elsewhere two renames); otherwise (an export into a folder
   holding the user's other files) the replaced entries of ``D`` are moved into an aside folder
   and the staged entries moved in, the commit markers (``last``: ``latest``, an index) last.
   The parent is fsynced, the commit recorded (:func:`was_committed`), the lock released; then
   the replaced entries are deleted, a replaced store's manifest first, so that whatever an
   interrupted deletion leaves never opens as a store.
4. :meth:`~LocalDestination.discard` (an error, Ctrl-C): the staging folder is removed and the
   lock released. :func:`left_on_disk` then says what is really there, read from the disk.

Readers refuse the transient names by construction (:func:`transient_name`): a staging folder,
the old folder of a two-rename swap and an aside folder never open as a store, whatever they
hold (a commit interrupted by SIGKILL may leave a staging folder with a manifest in it).

A mount point cannot be renamed: an export to one is staged in ``D/.ucformat-staging`` and
moved in entry by entry; a store is written into it in place (``in_place``), by the store's
own protocol (uncommitted first: :mod:`ucformat.store.lifecycle`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import uuid
from collections.abc import Callable, Collection
from pathlib import Path

from ucformat.errors import StoreExistsError
from ucformat.format.spec import MANIFEST_KEY
from ucformat.store.durable import fsync_path, sync_tree
from ucformat.store.writer_lock import acquire_local, release_local
from ucformat.sysio.interrupts import interrupts_deferred

__all__ = [
    "LocalDestination",
    "destination_key",
    "left_on_disk",
    "staging_path",
    "transient_name",
    "was_committed",
]

#: The staging folder inside a destination that is a mount point.
INSIDE_STAGING = ".ucformat-staging"
_STAGING_SUFFIX = ".ucformat-staging"
_ASIDE_PREFIX = ".ucformat-replaced-"
#: Names only a writer in progress (or killed) leaves: never a store, never an export's file
#: (``.ucformat-lock``: the lock inside a destination that is a mount point).
_TRANSIENT = re.compile(
    r"^(\..+\.ucformat-staging|\..+\.ucformat-old-[0-9a-f]+|\.ucformat-staging"
    r"|\.ucformat-replaced-[0-9a-f]+|\.ucformat-lock)$"
)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100

#: Destinations this process committed (what an interrupt message says about them).
_COMMITTED: set[str] = set()


def staging_path(destination: Path) -> Path:
    """Where a write to ``destination`` is staged (beside it; inside it for a mount point)."""
    destination = Path(os.path.abspath(destination))
    if os.path.ismount(destination):
        return destination / INSIDE_STAGING
    return destination.parent / f".{destination.name}{_STAGING_SUFFIX}"


def transient_name(name: str) -> bool:
    """Whether ``name`` is a folder only an unfinished (or killed) writer leaves."""
    return _TRANSIENT.match(name) is not None


def destination_key(target: str | os.PathLike[str]) -> str:
    """How :func:`was_committed` names a destination: an absolute local path, or the URL."""
    text = os.fspath(target)
    if "://" in text and not text.startswith("file://"):
        return text.rstrip("/")
    return os.path.abspath(text.removeprefix("file://"))


def mark_committed(target: str | os.PathLike[str]) -> None:
    """Record that this process committed ``target`` (object stores commit without a swap)."""
    _COMMITTED.add(destination_key(target))


def was_committed(target: str | os.PathLike[str]) -> bool:
    """Whether this process committed a write to ``target``."""
    return destination_key(target) in _COMMITTED


class LocalDestination:
    """The lifecycle of one write to the local folder ``path`` (see the module docstring).

    Args:
        path: the destination folder.
        fsync: make the staged files durable before the swap and the swap after it (the one
            durability option of every writer; off only for benchmarks and scratch output).
        in_place: write into ``path`` itself when it is a mount point (stores), instead of a
            staging folder inside it (exports).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, fsync: bool = True, in_place: bool = False
    ) -> None:
        self.path = Path(os.path.abspath(path))
        self.fsync = fsync
        mounted = os.path.ismount(self.path)
        self.staging = self.path if (mounted and in_place) else staging_path(self.path)
        self._inside = mounted and not in_place
        self.state = "new"

    @property
    def in_place(self) -> bool:
        """Whether the write goes into the destination itself (a store on a mount point)."""
        return self.staging == self.path

    def start(self, check: Callable[[Path], None] | None = None) -> Path:
        """Lock the destination, ``check(path)`` it, prepare the staging folder; return it.

        Raises:
            StoreBusyError: another writer holds the lock.
            StoreExistsError: ``path`` is a file, or ``check`` refused the destination.
            OSError: the lock or the staging folder cannot be created.
        """
        acquire_local(self.path)
        try:
            if self.path.exists() and not self.path.is_dir():
                raise StoreExistsError(
                    f"{self.path}: exists and is a file; choose a folder as destination."
                )
            if check is not None:
                check(self.path)
            if not self.in_place:
                if self.staging.exists():  # a killed writer's: the lock says it is gone
                    _remove(self.staging)
                self.staging.mkdir(parents=True)
        except BaseException:
            release_local(self.path)
            raise
        self.state = "started"
        return self.staging

    def sync(self) -> None:
        """With ``fsync``: make every file and directory written so far durable."""
        if self.fsync and self.staging.is_dir():
            sync_tree(self.staging)

    def commit(
        self,
        *,
        replaces: Callable[[str], bool] | None = None,
        last: Collection[str] = (),
        seal: Callable[[Path], None] | None = None,
        synced: bool = False,
    ) -> None:
        """Swap the staged write into place (the commit point), then delete what it replaced.

        Args:
            replaces: which existing entries of the destination the write replaces; None: the
                whole folder (a store). Entries the write itself holds are always replaced.
            last: staged entries moved in last when the destination is filled entry by entry.
            seal: called with the staging folder just before the swap, inside the block that
                holds Ctrl-C back (a store writes its manifest there).
            synced: the writers already made every staged object durable.
        """
        if not synced:
            self.sync()
        with interrupts_deferred():
            if seal is not None:
                seal(self.staging)
            replaced = [] if self.in_place else self._swap(replaces, last)
            self.state = "committed"
            _COMMITTED.add(str(self.path))
            try:
                if self.fsync:
                    fsync_path(self.path if self._inside else self.path.parent, directory=True)
            finally:
                release_local(self.path)
        for path in replaced:
            _remove(path)
        if self._inside:
            _remove(self.staging)

    def discard(self) -> None:
        """Remove the staged write (not a store written in place) and release the lock."""
        try:
            if self.state == "started" and not self.in_place:
                _remove(self.staging)
        finally:
            self.state = "discarded"
            release_local(self.path)

    def _swap(self, replaces: Callable[[str], bool] | None, last: Collection[str]) -> list[Path]:
        """Move the staged write into place; return the replaced folders to delete."""
        names = [p.name for p in self.path.iterdir()] if self.path.is_dir() else []
        names = [name for name in names if not (self._inside and name == INSIDE_STAGING)]
        staged = sorted(p.name for p in self.staging.iterdir())
        gone = [n for n in names if n in staged or (replaces is None or replaces(n))]
        if not self._inside and len(gone) == len(names):  # the whole folder is replaced
            if not names:
                if self.path.is_dir():
                    self.path.rmdir()
                os.rename(self.staging, self.path)
                return []
            if _exchange(self.staging, self.path):
                return [self.staging]  # the previous folder now lies at the staging path
            old = self.path.with_name(f".{self.path.name}.ucformat-old-{uuid.uuid4().hex}")
            os.rename(self.path, old)
            os.rename(self.staging, self.path)
            return [old]
        # Entry by entry: the entries the write replaces by name go aside, the staged ones
        # come in (the commit markers last), then the other replaced ones go aside.
        self.path.mkdir(parents=True, exist_ok=True)
        aside = self.path / f"{_ASIDE_PREFIX}{uuid.uuid4().hex[:12]}"
        if gone:
            aside.mkdir()
        for name in sorted(n for n in gone if n in staged):
            os.rename(self.path / name, aside / name)
        for name in sorted(staged, key=lambda name: name in last):
            os.rename(self.staging / name, self.path / name)
        for name in sorted(n for n in gone if n not in staged):
            os.rename(self.path / name, aside / name)
        if not self._inside:
            self.staging.rmdir()
        return [aside] if gone else []


def left_on_disk(target: str | os.PathLike[str]) -> str:
    """What the writes of this process left at the local destination ``target``, in words.

    Read from the disk (and from :func:`was_committed`), not from what the writer meant to do:
    "the write was committed; D is complete", or "nothing was committed; D is as it was", then
    every leftover of an unfinished write that is still there (none opens as a store).
    """
    path = Path(destination_key(target))
    if was_committed(path):
        said = f"the write was committed before the interrupt; {path} is complete"
    else:
        said = f"nothing was committed; {path} is as it was"
    leftovers = _leftovers(path)
    if leftovers:
        names = ", ".join(str(p) for p in leftovers)
        return (
            f"{said}; left behind by the unfinished write (no reader opens it, the next write "
            f"removes it, or delete it): {names}"
        )
    if was_committed(path):
        return said
    return f"{said} (no staged write is left beside it)"


def _leftovers(path: Path) -> list[Path]:
    found: list[Path] = []
    beside = path.parent
    if beside.is_dir():
        prefix = f".{path.name}.ucformat-"
        found += sorted(
            p for p in beside.iterdir() if p.name.startswith(prefix) and transient_name(p.name)
        )
    if path.is_dir():
        found += sorted(p for p in path.iterdir() if transient_name(p.name))
    return found


def _remove(path: Path) -> None:
    """Delete a folder the lifecycle no longer needs: a store's manifest first, so that what an
    interrupted deletion leaves is no committed store."""
    if path.is_dir() and not path.is_symlink():
        (path / MANIFEST_KEY).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
