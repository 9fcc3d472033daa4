"""Reads that land in device tensors, through pinned host windows: never a full-size host copy.

A store's bytes arrive in host memory, so a load into a CUDA tensor reads every range into a
host buffer and copies it to the device. :class:`DeviceStaging` bounds that buffer: it reads
each piece of the destination (a flat range of at most ``window_bytes``) into one of two
page-locked ("pinned") host windows and copies the window to its place in the device tensor
asynchronously (``non_blocking``), while the next piece is read into the other window; before a
window is filled again, the copy out of it is waited for (a CUDA event). Host memory is two
windows whatever the tensor's size, and the disk read of one piece overlaps the copy of the
last.

Nothing here needs a GPU to run: on a CPU destination (what a unit test drives) the windows
are plain host memory (``pin=False``) and each copy is synchronous; the pieces, the windows'
reuse and the values written are the same. :func:`host_buffer` gives the one host buffer of a
read that must be whole before anything is written (pinned when its destination is a device).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ucformat.format.dtypes import numpy_storage_dtype
from ucformat.sysio.memory import prefaulted_empty

__all__ = ["WINDOW_BYTES", "DeviceStaging", "host_buffer", "wants_pinned"]

#: Bytes of each of the two staging windows.
WINDOW_BYTES = 64 * 1024 * 1024

#: ``read(out)``: fill the storage-dtype host array ``out`` (one piece) from the store.
Reader = Callable[[np.ndarray], None]


def wants_pinned(device: torch.device | str | None) -> bool:
    """Whether host buffers bound for ``device`` should be page-locked: a CUDA device, with
    CUDA available (a copy from pinned memory is a DMA, from pageable memory a staged copy)."""
    if device is None:
        return False
    kind = torch.device(device).type
    return kind == "cuda" and torch.cuda.is_available()


def host_buffer(count: int, dtype: str, *, pin: bool = False) -> np.ndarray:
    """An uninitialised host array of ``count`` elements of the storage dtype of ``dtype`` (a
    manifest dtype name), page-locked when ``pin`` (its memory stays valid as long as the
    array: the array keeps the torch tensor that owns it)."""
    storage = numpy_storage_dtype(dtype)
    if not pin:
        return prefaulted_empty(count, storage)
    raw = torch.empty(count * storage.itemsize, dtype=torch.uint8, pin_memory=True)
    return raw.numpy().view(storage)


def _read_part(
    read: Callable[[np.ndarray, int, int], None], at: int, count: int, out: np.ndarray
) -> None:
    read(out, at, count)


class DeviceStaging:
    """Fills a flat device tensor piece by piece through two host windows.

    Call :meth:`put` for each piece (any order), then :meth:`finish` (waits for the last
    copies). ``dest`` is a contiguous tensor of the logical dtype ``dtype`` (bfloat16 gets the
    stored uint16 bit patterns, as the store holds them).

    Attributes:
        window_bytes: bytes of each window (a piece is at most this).
        pieces: pieces copied so far; host_bytes: bytes of host memory the windows hold.
    """

    def __init__(
        self,
        dest: torch.Tensor,
        dtype: str,
        *,
        window_bytes: int = WINDOW_BYTES,
        pin: bool | None = None,
    ) -> None:
        if not dest.is_contiguous():
            raise ValueError("a staged fill needs a contiguous destination")
        if dest.element_size() != numpy_storage_dtype(dtype).itemsize:
            raise ValueError(f"a {dest.dtype} destination cannot hold {dtype} values as stored")
        self.dest = dest.detach().reshape(-1)
        self.storage = numpy_storage_dtype(dtype)
        self.item = self.storage.itemsize
        self.pin = wants_pinned(dest.device) if pin is None else pin
        self.window_bytes = max(self.item, window_bytes - window_bytes % self.item)
        self.per_window = self.window_bytes // self.item
        size = min(self.window_bytes, self.dest.numel() * self.item) or self.item
        self._windows = [
            torch.empty(size, dtype=torch.uint8, pin_memory=self.pin) for _ in range(2)
        ]
        self._events: list[Any] = [None, None]
        self._turn = 0
        self.pieces = 0
        self.host_bytes = 2 * size

    def put(self, start: int, count: int, read: Reader) -> None:
        """Fill ``dest[start : start + count]`` (at most :attr:`per_window` elements) with
        what ``read`` writes into the host array it is given."""
        if count <= 0:
            return
        if count > self.per_window:
            raise ValueError(f"a piece of {count} elements exceeds the window's {self.per_window}")
        turn = self._turn
        self._turn ^= 1
        event = self._events[turn]
        if event is not None:  # the copy out of this window must be done before refilling it
            event.synchronize()
        window = self._windows[turn][: count * self.item]
        read(window.numpy().view(self.storage))
        # the stored bytes are the logical dtype's (bfloat16: its bit patterns)
        self.dest[start : start + count].copy_(window.view(self.dest.dtype), non_blocking=self.pin)
        if self.pin and self.dest.is_cuda:
            recorded = torch.cuda.Event()  # type: ignore[no-untyped-call]
            recorded.record()
            self._events[turn] = recorded
        self.pieces += 1

    def put_range(
        self, start: int, count: int, read: Callable[[np.ndarray, int, int], None]
    ) -> None:
        """Fill ``dest[start : start + count]`` in window-sized pieces: ``read(out, offset,
        n)`` writes elements ``[offset, offset + n)`` of the range into ``out``."""
        for offset in range(0, count, self.per_window):
            n = min(self.per_window, count - offset)
            self.put(start + offset, n, functools.partial(_read_part, read, offset, n))

    def finish(self) -> None:
        """Wait for every copy still in flight (the windows may then be freed or reused)."""
        for event in self._events:
            if event is not None:
                event.synchronize()
        self._events = [None, None]
