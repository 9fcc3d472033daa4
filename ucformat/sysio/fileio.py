"""Whole reads and writes at an offset: loops over ``preadv`` / ``pwrite`` until done.

Both calls may transfer less than asked (and ``preadv`` takes at most ``IOV_MAX`` buffers), so
every caller needs the same loop; it lives here once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["IOV_MAX", "preadv_all", "pwrite_all"]

#: Most buffers one ``preadv`` call takes (Linux ``IOV_MAX``).
IOV_MAX = 1024


def preadv_all(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Fill ``views`` in turn with the bytes of ``fd`` from ``offset`` on, one ``preadv`` per
    up to :data:`IOV_MAX` views; the number of bytes read (short only at end of file)."""
    pending = [view for view in views if len(view)]
    total, first = 0, 0
    while first < len(pending):
        got = os.preadv(fd, pending[first : first + IOV_MAX], offset + total)
        if got <= 0:
            break
        total += got
        while first < len(pending) and got >= len(pending[first]):
            got -= len(pending[first])
            first += 1
        if got:  # a short read stopped inside this view
            pending[first] = pending[first][got:]
    return total


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` to ``fd`` at ``offset``."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
