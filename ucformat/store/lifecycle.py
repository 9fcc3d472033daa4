"""A store's lifecycle around a write: lock and prepare the destination, discard a failed write.

The store's rules on top of the one destination lifecycle (:mod:`ucformat.store.destination`,
which every local writer, stores and exports, goes through). The commit itself (the manifest
written last, the staged store swapped into place, the lock released) is
:func:`ucformat.store.manifest_io.commit_manifest`. Every store writer (offline convert, live
saves, distributed convert) goes through these functions (docs/format.md §6):

* :func:`start_store` takes the destination's writer lock, checks the destination and writes
  the root group: into the staging folder beside a local destination (the destination itself,
  a previous store included, is left as it is until the commit), or into the destination
  prefix of an object store (whose previous manifest is deleted first);
* :func:`discard_store` removes what a failed write staged and releases the lock.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ucformat.errors import StoreExistsError
from ucformat.format.spec import FORMAT_NAME, FORMAT_VERSION, MANIFEST_KEY
from ucformat.store.arrays import create_root_group
from ucformat.store.keys import (
    Store,
    delete_key,
    describe_store,
    list_keys,
    local_root,
    store_writes,
)
from ucformat.store.manifest_io import ROOT_KEY
from ucformat.store.staged_local import StagedLocalStore
from ucformat.store.write_session import acquire_writer, release_writer
from ucformat.store.writer_lock import IN_PLACE_LOCK, LOCK_KEY

__all__ = ["discard_store", "prepare_destination", "start_store"]

#: What zarr's LocalStore leaves at the root when killed while writing a root object.
_PARTIAL_ROOT = re.compile(r"^(zarr|ucformat)\.[0-9a-f]{32}\.partial$")
#: Top-level folders of a store (format.md §2: ``stacks`` since format 3.1, ``params`` and
#: ``buffers`` before): a folder holding only these (and root objects) is one an interrupted
#: ucformat write left, and may be overwritten.
_STORE_FOLDERS = frozenset({"stacks", "params", "buffers"})


def start_store(store: Store, overwrite: bool, format_version: str = FORMAT_VERSION) -> bool:
    """Lock the destination, check it (see ``overwrite``) and write the root group: an
    uncommitted store. ``format_version`` goes into the root group's attribute: the manifest's
    (the plan's version), so the two agree.

    A local store goes through its :class:`~ucformat.store.destination.LocalDestination`
    (lock, check, staging folder beside it); any other store takes its lock object and is
    emptied in place (its manifest first).

    Returns:
        True if the destination did not exist before (local stores), for :func:`discard_store`.

    Raises:
        StoreBusyError: another writer holds the destination's lock.
        StoreExistsError: the destination holds data and ``overwrite`` is off, or it holds
            something that is not a ucformat store.
        StoreWriteError: the destination cannot be written (permissions, space, network).
    """
    created = False
    if isinstance(store, StagedLocalStore):
        local = store.staged
        created = not local.path.exists()
        with store_writes(store, "preparing the destination"):
            local.start(lambda path: _check_local(store, path, overwrite))
    else:
        with store_writes(store, "locking the destination"):
            acquire_writer(store)
    try:
        if not isinstance(store, StagedLocalStore):
            with store_writes(store, "preparing the destination"):
                created = prepare_destination(store, overwrite)
        with store_writes(store, f"writing {ROOT_KEY}"):
            create_root_group(
                store, {FORMAT_NAME: {"format_version": format_version, "manifest": MANIFEST_KEY}}
            )
    except BaseException:
        discard_store(store, False)
        raise
    return created


def discard_store(store: Store, created: bool) -> None:
    """Remove what a failed write left and release the lock.

    A staged local write removes its staging folder (the destination is untouched: a previous
    store stays complete); a store written in place (a mount point) or into an object store is
    left uncommitted (its previous manifest was deleted by :func:`start_store`); any other local
    store is removed if the write ``created`` it.
    """
    if isinstance(store, StagedLocalStore):
        if store.staged.state != "committed":
            store.staged.discard()
        return
    try:
        root = local_root(store)
        if created and root is not None:
            shutil.rmtree(root, ignore_errors=True)
    finally:
        release_writer(store)


def _check_local(store: StagedLocalStore, path: Path, overwrite: bool) -> None:
    """The rule of a local store's destination: empty, or a ucformat store and ``overwrite``;
    a store written in place (a mount point) is emptied here, its manifest first."""
    if store.staged.in_place:
        prepare_destination(store, overwrite)
        return
    names = {p.name for p in path.iterdir()} if path.exists() else set()
    if names:
        _check_ours(path, names, overwrite)


def _check_ours(root: Path, names: set[str], overwrite: bool) -> None:
    """Refuse a non-empty local destination unless it is a ucformat store and ``overwrite``
    (a folder that is no store is refused whatever ``overwrite`` says, so the message never
    suggests it)."""
    ours = names & {MANIFEST_KEY, ROOT_KEY} or all(
        _PARTIAL_ROOT.match(name) or (name in _STORE_FOLDERS and (root / name).is_dir())
        for name in names
    )
    if not ours:
        raise StoreExistsError(
            f"{root}: exists and is not a ucformat store (no {ROOT_KEY} or {MANIFEST_KEY}); "
            "refusing to overwrite it. Choose an empty or new destination."
        )
    if not overwrite:
        raise StoreExistsError(
            f"{root}: already exists and is not empty; pass overwrite=True to replace it."
        )


def prepare_destination(store: Store, overwrite: bool) -> bool:
    """Check the destination and empty what the write will fill; return True if the
    destination did not exist before (local stores).

    The caller holds the destination's lock. A local store written in place (a mount point) is
    emptied in place; an object store loses its manifest first, then every other key. (A staged
    local store is checked by :func:`start_store`: its destination stays as it is.)
    """
    root = local_root(store)
    if root is not None:
        if root.exists() and not root.is_dir():
            raise StoreExistsError(f"{root}: exists and is a file; choose another destination.")
        children = [p for p in root.iterdir() if p.name != IN_PLACE_LOCK] if root.exists() else []
        if not children:
            return not root.exists()
        _check_ours(root, {p.name for p in children}, overwrite)
        # Uncommit first and remove the root marker last, so that a crash in between leaves
        # a store that is incomplete and still recognisably ours (a re-run can overwrite it).
        delete_key(store, MANIFEST_KEY)
        for child in sorted(children, key=lambda child: child.name == ROOT_KEY):
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()
        return False
    keys = [key for key in list_keys(store) if key != LOCK_KEY]
    if keys and not overwrite:
        raise StoreExistsError(
            f"{describe_store(store)}: already holds data; pass overwrite=True to replace it."
        )
    if keys:
        delete_key(store, MANIFEST_KEY)
        for key in sorted(keys, key=lambda key: key == ROOT_KEY):
            delete_key(store, key)
    return False
