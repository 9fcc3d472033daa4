"""Whole reads and writes at an offset (loops over ``preadv`` / ``pwrite`` until done), and a
file written under a temporary name, renamed over its own when complete.

Both calls may transfer less than asked (and ``preadv`` takes at most ``IOV_MAX`` buffers), so
every caller needs the same loop; it lives here once. :func:`replacing` is how every whole file
ucformat writes appears: ``<stem>.<hex>.partial``, renamed when the block ends normally, removed
if it raises (zarr's ``LocalStore`` writes the same way), so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["IOV_MAX", "preadv_all", "pwrite_all", "replacing"]

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


@contextlib.contextmanager
def replacing(path: Path, *, make_folder: bool = False) -> Iterator[int]:
    """A descriptor open for writing ``<stem>.<hex>.partial`` beside ``path``, renamed over it
    when the block exits normally and removed if it raises; ``make_folder``: make ``path``'s
    folder if it is missing."""
    partial = path.with_suffix(f".{uuid.uuid4().hex}.partial")  # zarr's own naming
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(partial, flags, 0o644)
    except FileNotFoundError:
        if not make_folder:
            raise
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(partial, flags, 0o644)
    try:
        yield fd
    except BaseException:
        os.close(fd)
        partial.unlink(missing_ok=True)
        raise
    os.close(fd)
    partial.replace(path)
