"""Where each timed save of a benchmark worker goes, and what the disk holds before it.

Two protocols (docs/benchmarks.md, "Live saves: the protocol"):

* ``fresh`` (the default): every save gets a destination of its own (the first of a kind its
  base name, then ``<base>-1``, ``<base>-2``...), nothing is deleted while the launch runs, and
  every dirty page is written back (``os.sync``, not timed) before each timed save: a training
  job whose saves are minutes apart, each starting on a disk that has written the last one.
  The launch also waits until ``not_before`` (the caller's deadline: a minute after it deleted
  the previous case's files, see below) before its first save.
* ``delete`` (the protocol of the tables before stop 25): one destination per kind, emptied
  just before each save. The stock saves then reuse the page cache of the files just deleted
  (whose data never reached the disk), and on ext4 without a journal every file a save creates
  skips each inode freed in the last 60 seconds (the kernel's ``recently_deleted``): a store of
  thousands of files pays for the thousands deleted just before it, a stock save's few files
  do not. Kept to compare with the earlier tables.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

__all__ = ["PROTOCOLS", "Destinations", "INODE_QUIET_S", "remove_outputs"]

PROTOCOLS = ("fresh", "delete")

#: Seconds after a deletion before ext4 (without a journal) reuses the freed inodes freely: the
#: kernel's ``RECENTCY_MIN``, 60 s, once the inode tables are written back (plus a margin).
INODE_QUIET_S = 65.0


class Destinations:
    """Hands out each timed save's destination under ``protocol``; call on every rank, before
    the barrier that starts the timing."""

    def __init__(self, protocol: str, rank: int, not_before: float = 0.0) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        self.protocol, self.rank, self.not_before = protocol, rank, not_before
        self._uses: dict[Path, int] = {}

    def next(self, base: Path) -> Path:
        """The destination of the next save of kind ``base`` (ready to be written)."""
        time.sleep(max(0.0, self.not_before - time.time()))
        if self.protocol == "delete":
            if self.rank == 0:
                shutil.rmtree(base, ignore_errors=True)
            return base
        uses = self._uses.get(base, 0)
        self._uses[base] = uses + 1
        os.sync()  # every rank: the previous saves' pages are on the disk before the timing
        return base if uses == 0 else base.with_name(f"{base.name}-{uses}")


def remove_outputs(folder: Path, names: tuple[str, ...]) -> float:
    """Remove every save output of ``folder`` named ``name`` or ``name-<i>`` for ``names``, then
    write the deletion back; returns the time before which the next launch should not save
    (:data:`INODE_QUIET_S` from now)."""
    for name in names:
        for path in [folder / name, *folder.glob(f"{name}-*")]:
            shutil.rmtree(path, ignore_errors=True)
    os.sync()
    return time.time() + INODE_QUIET_S
