"""Python's cyclic garbage collector held off while a blocking save runs.

A training process holds millions of Python objects (the model, the optimizer, the framework's
own state), so a full collection of the oldest generation takes a quarter of a second there
(docs/benchmarks.md); planning a save allocates enough objects to start one, on the critical
path of every rank, each at its own moment, so the others wait for it at the next agreement.
The save's own objects are freed by reference counting; the collector runs again, as before,
once the save returns.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collection_paused"]


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Disable automatic garbage collection inside the block; restore it after, unless the
    caller had it disabled already."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
