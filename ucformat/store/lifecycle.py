"""A store's lifecycle around a write: prepare the destination, discard a failed write.

The commit itself (the manifest written last) is :func:`ucformat.store.manifest_io.commit_manifest`.
Every writer (offline convert, live saves, distributed convert) goes through these functions.
"""

from __future__ import annotations

import re
import shutil

from ucformat.errors import StoreExistsError
from ucformat.format.spec import FORMAT_NAME, FORMAT_VERSION, MANIFEST_KEY
from ucformat.store.arrays import create_root_group
from ucformat.store.keys import Store, delete_key, list_keys, local_root, store_writes
from ucformat.store.manifest_io import ROOT_KEY

__all__ = ["discard_store", "prepare_destination", "start_store"]

#: What zarr's LocalStore leaves at the root when killed while writing a root object.
_PARTIAL_ROOT = re.compile(r"^(zarr|ucformat)\.[0-9a-f]{32}\.partial$")


def start_store(store: Store, overwrite: bool) -> bool:
    """Empty ``store`` (see ``overwrite``) and write its root group: an uncommitted store.

    Returns:
        True if the store did not exist before (local stores), for :func:`discard_store`.

    Raises:
        StoreExistsError: the destination holds data and ``overwrite`` is off, or it holds
            something that is not a ucformat store.
    """
    with store_writes(store, "preparing the destination"):
        created = prepare_destination(store, overwrite)
    with store_writes(store, f"writing {ROOT_KEY}"):
        create_root_group(
            store, {FORMAT_NAME: {"format_version": FORMAT_VERSION, "manifest": MANIFEST_KEY}}
        )
    return created


def discard_store(store: Store, created: bool) -> None:
    """Remove a store a failed write created (local stores; others stay uncommitted)."""
    root = local_root(store)
    if created and root is not None:
        shutil.rmtree(root, ignore_errors=True)


def prepare_destination(store: Store, overwrite: bool) -> bool:
    """Make ``store`` empty; return True if it did not exist before (local stores)."""
    root = local_root(store)
    if root is not None:
        if root.exists() and not root.is_dir():
            raise StoreExistsError(f"{root}: exists and is a file; choose another destination.")
        if not root.exists() or not any(root.iterdir()):
            return not root.exists()
        names = {p.name for p in root.iterdir()}
        if not overwrite:
            raise StoreExistsError(
                f"{root}: already exists and is not empty; pass --overwrite to replace it."
            )
        if not names & {MANIFEST_KEY, ROOT_KEY} and not all(map(_PARTIAL_ROOT.match, names)):
            raise StoreExistsError(
                f"{root}: exists and is not a ucformat store (no {ROOT_KEY} or {MANIFEST_KEY}); "
                "refusing to overwrite it. Choose an empty or new destination."
            )
        # Uncommit first and remove the root marker last, so that a crash in between leaves
        # a store that is incomplete and still recognisably ours (a re-run can overwrite it).
        delete_key(store, MANIFEST_KEY)
        for child in sorted(root.iterdir(), key=lambda child: child.name == ROOT_KEY):
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()
        return False
    keys = list_keys(store)
    if keys and not overwrite:
        raise StoreExistsError(f"{store}: already holds data; pass --overwrite to replace it.")
    if keys:
        delete_key(store, MANIFEST_KEY)
        for key in sorted(keys, key=lambda key: key == ROOT_KEY):
            delete_key(store, key)
    return False
