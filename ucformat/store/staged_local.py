"""A local store written beside its destination and swapped into place at the commit.

The zarr face of :class:`~ucformat.store.destination.LocalDestination`: a writable
:class:`LocalStore` whose root is the destination's staging folder ``.<name>.ucformat-staging``
(docs/format.md §6.2), so every object a writer stores lands there; the commit
(:func:`ucformat.store.manifest_io.commit_manifest`) has the destination swap it into place,
after which ``root`` is the destination itself. The staging name is fixed by the destination,
so every rank of a distributed write opens the same folder; one writer at a time is enforced
by the destination's lock. A mount point cannot be renamed: a store there is written in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zarr.storage import LocalStore

from ucformat.store.destination import LocalDestination, staging_path

__all__ = ["StagedLocalStore", "staging_path"]


class StagedLocalStore(LocalStore):
    """A writable :class:`LocalStore` whose root is the staging folder of ``destination``.

    ``staged`` is the write's :class:`~ucformat.store.destination.LocalDestination`; after the
    commit, ``root`` is the destination itself.
    """

    staged: LocalDestination

    def __init__(self, root: Path | str, *, read_only: bool = False) -> None:
        self.staged = LocalDestination(root, in_place=True)
        super().__init__(self.staged.staging, read_only=read_only)

    @property
    def destination(self) -> Path:
        """The folder the store is committed to."""
        return self.staged.path

    def with_read_only(self, read_only: bool = False) -> Any:
        """A plain local store at the current root (readers never see staging folders)."""
        return LocalStore(self.root, read_only=read_only)

    def __repr__(self) -> str:
        return f"StagedLocalStore({str(self.destination)!r})"
