"""Exports to a URL (``s3://bucket/prefix``): written to a local staging folder, then uploaded.

Every export target writes a folder of files (safetensors shards, DeepSpeed's ``.pt`` files).
For a URL destination the export runs unchanged into a fresh temporary folder (under
``$TMPDIR``; it needs as much free space as the export writes), then each file is uploaded
through fsspec, the files that mark a finished export (``latest``, ``latest_universal``, the
safetensors index) last, so a reader that finds them finds every file they name. The staging
folder is removed afterwards, whatever happens.

``overwrite`` has the local meaning: a destination with objects under it is refused without it;
with it, only the entries the export owns are removed first (other objects are kept).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from ucformat.errors import StoreAccessError, StoreExistsError, StoreWriteError, UCFormatError
from ucformat.export.common import ExportResult
from ucformat.export.destination import export_session
from ucformat.store.destination import mark_committed
from ucformat.store.locations import local_directory

__all__ = ["export_to_url", "is_url"]


def is_url(out: str | os.PathLike[str]) -> bool:
    """Whether ``out`` is a URL rather than a local folder (``file://`` counts as local)."""
    return local_directory(out) is None


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise StoreAccessError(
            f"{url}: cannot open this URL ({exc}); install the fsspec backend for its protocol "
            "(e.g. s3fs: pip install 'ucformat[s3]') or give a local folder."
        ) from None
    return fs, str(root).rstrip("/")


def export_to_url(
    url: str,
    run: Callable[[Path], ExportResult],
    *,
    owned: Callable[[str], bool],
    overwrite: bool,
    dry_run: bool,
    last: Collection[str] = (),
) -> ExportResult:
    """Run the export ``run(folder)`` into a staging folder, then upload it to ``url``.

    Args:
        url: the destination folder's URL.
        run: the export itself, writing into the local folder it is given.
        owned: whether a top-level entry name belongs to this export (removed by overwrite).
        overwrite: replace the owned entries of a destination that is not empty.
        dry_run: plan only: run the export as a dry run, upload nothing.
        last: top-level file names uploaded after everything else (commit markers).

    Raises:
        StoreExistsError: the destination holds objects and ``overwrite`` is not set.
        StoreWriteError: an upload failed (files uploaded before it stay; no commit marker
            was uploaded unless every other file was).
    """
    fs, root = _filesystem(url)
    try:
        existing = sorted(fs.ls(root, detail=False)) if fs.exists(root) else []
    except OSError as exc:
        raise StoreWriteError(f"{url}: cannot list the destination ({exc}).") from None
    names = sorted({str(entry).rstrip("/").rpartition("/")[2] for entry in existing})
    if names and not overwrite:
        raise StoreExistsError(
            f"{url}: already holds objects; pass overwrite=True to replace the files this export "
            "writes (other objects are kept), or choose an empty prefix."
        )
    with tempfile.TemporaryDirectory(prefix="ucformat-export-") as staging:
        with export_session():  # committed into the local folder before the upload
            result = run(Path(staging))
        if not dry_run:
            try:
                for name in names:
                    if owned(name):
                        fs.rm(f"{root}/{name}", recursive=True)
                files = sorted(
                    (path for path in Path(staging).rglob("*") if path.is_file()),
                    key=lambda path: (path.relative_to(staging).parts[0] in last, str(path)),
                )
                for path in files:
                    fs.put_file(str(path), f"{root}/{path.relative_to(staging).as_posix()}")
            except UCFormatError:
                raise
            except OSError as exc:
                raise StoreWriteError(
                    f"{url}: uploading the export failed ({type(exc).__name__}: "
                    f"{str(exc)[:200]}); check the bucket, credentials and endpoint, then re-run "
                    "with overwrite=True."
                ) from None
            mark_committed(url)
        summary = result.summary.replace(staging, url)
    return dataclasses.replace(result, out=url, summary=summary)
