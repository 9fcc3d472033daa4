"""Where a store lives: a local directory, or a URL only a zarr store can reach.

Pure path logic with no zarr or torch import, shared by :func:`ucformat.store.keys.open_store` and
the manifest-only path of ``ucformat inspect`` (:func:`ucformat.store.manifest_io.load_manifest`).
"""

from __future__ import annotations

import os
from pathlib import Path

from ucformat.errors import NotAStoreError, SourceNotFoundError

__all__ = ["existing_store_directory", "local_directory"]


def local_directory(target: str | os.PathLike[str]) -> Path | None:
    """The local path ``target`` names (``file://`` stripped), or None for any other URL."""
    text = os.fspath(target)
    if "://" in text and not text.startswith("file://"):
        return None
    return Path(text.removeprefix("file://"))


def existing_store_directory(path: Path) -> Path:
    """``path``, checked to be an existing directory, as a store opened for reading must be.

    Raises:
        SourceNotFoundError: nothing is at ``path``.
        NotAStoreError: ``path`` is a file.
    """
    if not path.exists():
        raise SourceNotFoundError(f"{path}: no such store.")
    if not path.is_dir():
        raise NotAStoreError(
            f"{path}: is a file, not a ucformat store (a directory written by 'ucformat convert')."
        )
    return path
