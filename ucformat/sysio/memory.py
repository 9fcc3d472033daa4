"""Large uninitialised buffers whose pages are mapped before they are filled.

A fresh ``np.empty`` of hundreds of MiB gets its pages one fault at a time while a read fills
it; on the machines measured (docs/benchmarks.md) that first touch cost more than the read
itself. One anonymous ``mmap`` with ``MAP_POPULATE`` maps every page in a single call instead
(2 to 4x faster for a 186 MiB read from the page cache). Linux only; elsewhere, and for small
buffers, this is plain ``np.empty``. The memory is freed when the last array using it goes.
"""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["prefaulted_empty"]

#: Below this size the page faults cost nothing worth a system call.
_MIN_BYTES = 1 << 20
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def prefaulted_empty(count: int, dtype: np.dtype[np.generic]) -> np.ndarray:
    """A 1-D array of ``count`` uninitialised ``dtype`` elements, its pages already mapped."""
    nbytes = count * dtype.itemsize
    if nbytes < _MIN_BYTES or not _POPULATE or not _FLAGS:
        return np.empty(count, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=_FLAGS | _POPULATE)
    return np.frombuffer(region, dtype=dtype, count=count)
