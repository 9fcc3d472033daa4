"""W ranks as threads of one process, for the read-once executor's unit tests.

:class:`ThreadTransport` is a :class:`ucformat.read.once.Transport` whose all-to-alls and
gatherings meet at a barrier: what the gloo group does between processes, done between
threads (each collective call is a round of a :class:`threading.Barrier`). :func:`run_ranks`
runs one function per rank on its own thread and returns their results (raising the first
error).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


class _Meeting:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=120)
        self.slots: list[Any] = [None] * world_size


class ThreadTransport:
    """One rank's end of a threads-only transport (see the module docstring)."""

    def __init__(self, meeting: _Meeting, rank: int) -> None:
        self._meeting = meeting
        self.rank = rank
        self.world_size = meeting.world_size
        self.calls = 0

    def _all(self, value: Any) -> list[Any]:
        self.calls += 1
        meeting = self._meeting
        meeting.barrier.wait()
        meeting.slots[self.rank] = value
        meeting.barrier.wait()
        everyone = list(meeting.slots)
        meeting.barrier.wait()
        return everyone

    def blobs(self, out: list[np.ndarray]) -> list[np.ndarray]:
        everyone = self._all([blob.copy() for blob in out])
        return [everyone[sender][self.rank] for sender in range(self.world_size)]

    def sized(self, out: list[np.ndarray], receive: list[int]) -> list[np.ndarray]:
        got = self.blobs(out)
        for sender, (blob, size) in enumerate(zip(got, receive, strict=True)):
            if blob.nbytes != size:
                raise AssertionError(f"rank {self.rank}: {blob.nbytes} bytes from {sender}, "
                                     f"expected {size}")  # fmt: skip
        return [blob.reshape(-1).view(np.uint8) for blob in got]

    def gather(self, values: list[int]) -> list[list[int]]:
        return [list(v) for v in self._all(list(values))]


def transports(world_size: int) -> list[ThreadTransport]:
    """One transport per rank of a new threads-only job."""
    meeting = _Meeting(world_size)
    return [ThreadTransport(meeting, rank) for rank in range(world_size)]


def run_ranks(world_size: int, body: Callable[[ThreadTransport], T]) -> list[T]:
    """Run ``body`` on ``world_size`` threads, one per rank; their results in rank order."""
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []
    ends = transports(world_size)

    def target(rank: int) -> None:
        try:
            results[rank] = body(ends[rank])
        except BaseException as exc:  # reported below
            errors.append(exc)
            ends[rank]._meeting.barrier.abort()

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results
