"""Ctrl-C held back while a commit runs, so that it happens entirely or not at all.

A commit is a few renames and fsyncs (:mod:`ucformat.store.destination`). A ``KeyboardInterrupt``
raised between two of them would leave the writer not knowing whether its destination was
replaced, and its user a message that may be wrong. Inside :func:`interrupts_deferred`, a
SIGINT that arrives is only recorded; when the block ends, the previous handler runs (Python's
default raises ``KeyboardInterrupt`` there), after the commit and its bookkeeping are done.

Python runs signal handlers in the main thread only, so only the main thread can be
interrupted, and only there is the handler swapped; elsewhere the block runs as it is.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["interrupts_deferred"]


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Record SIGINT inside the block; deliver it to the previous handler when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: Any = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN, SIG_DFL or a handler not set from Python
        yield
        return
    pending: list[tuple[int, FrameType | None]] = []

    def record(signum: int, frame: FrameType | None) -> None:
        pending.append((signum, frame))

    signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            previous(*pending[0])
