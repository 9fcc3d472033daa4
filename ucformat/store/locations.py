"""Where a store lives: a local directory, or a URL only a zarr store can reach.

Pure path logic with no zarr or torch import, shared by :func:`ucformat.store.keys.open_store` and
the manifest-only path of ``ucformat inspect`` (:func:`ucformat.store.manifest_io.load_manifest`).
"""

from __future__ import annotations

import os
from pathlib import Path

from ucformat.errors import (
    IncompleteStoreError,
    NotAStoreError,
    SourceNotFoundError,
    UnsupportedCheckpointError,
)

__all__ = ["existing_store_directory", "local_directory", "local_source"]


def local_directory(target: str | os.PathLike[str]) -> Path | None:
    """The local path ``target`` names (``file://`` stripped), or None for any other URL."""
    text = os.fspath(target)
    if "://" in text and not text.startswith("file://"):
        return None
    return Path(text.removeprefix("file://"))


def existing_store_directory(path: Path) -> Path:
    """``path``, checked to be an existing directory, as a store opened for reading must be.

    A folder only an unfinished writer leaves (a staging folder, the old store of a swap:
    :func:`ucformat.store.destination.transient_name`) is refused whatever it holds: a writer
    killed between writing its manifest there and the swap leaves one that looks complete.

    Raises:
        SourceNotFoundError: nothing is at ``path``.
        NotAStoreError: ``path`` is a file.
        IncompleteStoreError: ``path`` is a staging folder (docs/format.md §6.2).
    """
    from ucformat.store.destination import transient_name

    name = Path(os.path.abspath(path)).name
    if transient_name(name) and path.is_dir():
        raise IncompleteStoreError(
            f"{path}: the staging folder of an unfinished ucformat write, not a store (it was "
            "interrupted or is still running); open the destination it was written for, or "
            "re-run that write. The next write to that destination removes it."
        )
    if not path.exists():
        raise SourceNotFoundError(f"{path}: no such store.")
    if not path.is_dir():
        raise NotAStoreError(
            f"{path}: is a file, not a ucformat store (a directory written by 'ucformat convert')."
        )
    return path


def local_source(src: str | os.PathLike[str]) -> Path:
    """The local folder of a DeepSpeed source checkpoint; a URL is refused in one line.

    Raises:
        UnsupportedCheckpointError: ``src`` is a URL (``s3://...``): DeepSpeed's per-rank files
            are read from local disk (by offset, with ``preadv``); stores may be URLs.
    """
    path = local_directory(src)
    if path is None:
        text = os.fspath(src)
        raise UnsupportedCheckpointError(
            f"{text}: DeepSpeed checkpoints are read from a local folder only; copy it first "
            f"(e.g. 'aws s3 sync {text} ./ckpt') and give that folder. The ucformat store "
            "itself may be a URL."
        )
    return path
