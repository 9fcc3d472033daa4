"""Saves that finish in a background thread (``save_async``), one at a time per process.

:func:`start` runs a write in a new thread and returns its :class:`SaveHandle`;
:func:`wait_for_pending` waits for the one still running (every save and ``save_async`` of
``ucformat.deepspeed`` and ``ucformat.torch`` calls it first, so saves never overlap and their
collectives never interleave).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

__all__ = ["SaveHandle", "start", "wait_for_pending"]

T = TypeVar("T")


class SaveHandle(Generic[T]):
    """An asynchronous save in progress."""

    def __init__(self, future: Future[T], thread: threading.Thread) -> None:
        self._future = future
        self._thread = thread

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> T:
        """Wait for the save; its result, or the error it failed with.

        Raises:
            CollectiveError: some rank failed; nothing was committed.
            TimeoutError: not finished within ``timeout`` seconds.
        """
        return self._future.result(timeout)

    def join(self) -> None:
        """Wait for the background thread to end (its error stays on the handle)."""
        self._thread.join()


_lock = threading.Lock()
_pending: SaveHandle[object] | None = None


def wait_for_pending() -> None:
    """Wait for this process's save still running in the background, if any."""
    with _lock:
        previous = _pending
    if previous is not None:
        previous.join()


def start(write: Callable[[], T], name: str = "ucformat-save") -> SaveHandle[T]:
    """Run ``write`` in a new (non-daemon) thread; the handle to its result."""
    global _pending
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(write())
        except BaseException as exc:
            future.set_exception(exc)

    thread = threading.Thread(target=run, name=name, daemon=False)
    handle = SaveHandle(future, thread)
    with _lock:
        _pending = handle  # type: ignore[assignment]
    thread.start()
    return handle
