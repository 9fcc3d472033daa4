"""CRC-32 of a zip member from the pieces a reader happened to read, in any order.

A ``torch.save`` archive records the CRC-32 (ISO-HDLC, zlib's ``crc32``) of each member. The
converter reads storage members piece by piece, from many threads, in whatever order the shards
it writes need them, and never reads some bytes at all (ZeRO padding). :class:`MemberCrc`
records the CRC of each piece as it is read (``zlib.crc32`` releases the GIL), then
:meth:`MemberCrc.value` reads the bytes nobody read and joins every piece in file order with
:func:`crc32_combine` (zlib's algorithm: multiply by ``x**(8 * len)`` modulo the CRC
polynomial). So each byte is read once and checksummed once, however it was consumed.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Sequence

__all__ = ["MemberCrc", "crc32_combine"]

_POLY = 0xEDB88320  # the reflected CRC-32 polynomial
_ONE = 1 << 31  # the polynomial 1 (x**0), reflected


def _multiply(a: int, b: int) -> int:
    """``a(x) * b(x)`` modulo the CRC polynomial (reflected bit order)."""
    product = 0
    mask = _ONE
    while mask:
        if a & mask:
            product ^= b
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    table = [1 << 30]  # x**1
    for _ in range(31):
        table.append(_multiply(table[-1], table[-1]))  # x**(2**k)
    return table


_X_POW_2K = _powers()


def _x_pow_8n(n: int) -> int:
    """``x**(8 n)`` modulo the CRC polynomial."""
    power, k = _ONE, 3
    while n:
        if n & 1:
            power = _multiply(_X_POW_2K[k & 31], power)
        n >>= 1
        k += 1
    return power


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    return _multiply(_x_pow_8n(length2), crc1) ^ crc2


#: Reads ``length`` bytes of the member from byte ``start`` on.
ReadRange = Callable[[int, int], bytes]

_GAP_READ = 4 << 20


class MemberCrc:
    """CRCs of the pieces read of one zip member of ``size`` bytes (thread-safe)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._pieces: dict[int, tuple[int, int]] = {}  # start -> (length, crc)
        self._lock = threading.Lock()

    def add(self, start: int, views: Sequence[memoryview]) -> None:
        """Record the bytes ``views`` hold, consecutive from byte ``start`` of the member."""
        crc, length = 0, 0
        for view in views:
            crc = zlib.crc32(view, crc)
            length += len(view)
        if length:
            with self._lock:
                self._pieces.setdefault(start, (length, crc))

    def value(self, read: ReadRange) -> int:
        """The CRC-32 of the whole member: recorded pieces, and ``read`` for the rest."""
        with self._lock:
            pieces = sorted(self._pieces.items())
        crc, position = 0, 0
        for start, (length, piece) in pieces:
            if start < position:  # pieces overlap (read twice, differently cut): recompute
                return self._whole(read)
            crc = self._span(crc, position, start, read)
            crc, position = crc32_combine(crc, piece, length), start + length
        return self._span(crc, position, self.size, read)

    def _whole(self, read: ReadRange) -> int:
        return self._span(0, 0, self.size, read)

    @staticmethod
    def _span(crc: int, start: int, stop: int, read: ReadRange) -> int:
        """``crc`` extended by the member's bytes ``[start, stop)``, read now."""
        while start < stop:
            block = read(start, min(_GAP_READ, stop - start))
            if not block:
                raise EOFError(f"member ends at byte {start} of {stop}")
            crc = zlib.crc32(block, crc)
            start += len(block)
        return crc
