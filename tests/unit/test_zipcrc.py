"""CRC-32 of a zip member from pieces read in any order (ucformat.sources.zipcrc) vs zlib."""

from __future__ import annotations

import itertools
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from ucformat.sources.zipcrc import MemberCrc, crc32_combine


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000), st.binary(max_size=2000))
def test_combine_matches_zlib(a: bytes, b: bytes) -> None:
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=3000), st.data())
def test_pieces_in_any_order_with_gaps_and_overlaps(data: bytes, draw: st.DataObject) -> None:
    member = MemberCrc(len(data))
    cuts = sorted(draw.draw(st.sets(st.integers(0, len(data)), max_size=12)) | {0, len(data)})
    pieces = list(itertools.pairwise(cuts))
    keep = [p for p in pieces if draw.draw(st.booleans())]  # the rest are gaps, read at the end
    overlap = draw.draw(st.booleans()) and len(data) > 2
    if overlap:
        keep.append((1, len(data) - 1))
    for start, stop in draw.draw(st.permutations(keep)):
        view = memoryview(data)[start:stop]
        split = draw.draw(st.integers(0, len(view)))
        member.add(start, [view[:split], view[split:]])  # scattered into two buffers
    reads: list[tuple[int, int]] = []

    def read(start: int, length: int) -> bytes:
        reads.append((start, length))
        return data[start : start + length]

    assert member.value(read) == zlib.crc32(data)
    if not overlap:
        assert sum(length for _, length in reads) == len(data) - sum(b - a for a, b in keep)
