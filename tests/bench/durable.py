"""What makes a stock save (``save_checkpoint``, ``dcp.save``) as durable as a ucformat save.

ucformat's saves fsync every object and directory they wrote before the commit (docs/format.md
§6); DeepSpeed's ``save_checkpoint`` and torch's ``dcp.save`` leave the writeback to the OS.
For a like-for-like durable comparison the benchmark workers time the stock save followed by
:func:`fsync_share` on every rank: each rank fsyncs every ``world``-th file of the sorted tree,
rank 0 also every directory (in parallel over the ranks, as ucformat's writers fsync theirs).
"""

from __future__ import annotations

import os
from pathlib import Path


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_share(folder: Path, rank: int, world: int) -> int:
    """fsync this rank's share of the files under ``folder`` (rank 0: and every directory);
    returns how many files it fsynced."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    mine = files[rank::world]
    for path in mine:
        _fsync(path, os.O_RDONLY)
    if rank == 0:
        for path in sorted({p.parent for p in files} | {folder}):
            _fsync(path, os.O_RDONLY | os.O_DIRECTORY)
    return len(mine)
