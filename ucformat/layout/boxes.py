"""Pure geometry of box-shaped chunks of a row-major tensor (PyTorch DCP's chunks).

A PyTorch Distributed Checkpoint stores each tensor as chunks: boxes given by ``offsets`` and
``sizes`` in the global tensor (FSDP2's dim-0 shards, uneven last shards, 2-D tensor-parallel
blocks, ...). The store holds flat row-major arrays, so a reader needs each chunk as runs of
consecutive global elements (:func:`chunk_runs`), and a writer needs the chunks to cut a tensor
into (:func:`row_chunks`). Standard library only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from math import ceil, prod

from ucformat.errors import LayoutMismatchError

__all__ = ["Run", "RowChunk", "chunk_runs", "row_chunks"]


@dataclass(frozen=True)
class Run:
    """Global flat elements ``[start, start + length)`` are chunk elements from ``chunk_start``."""

    start: int
    chunk_start: int
    length: int


@dataclass(frozen=True)
class RowChunk:
    """Rows ``[row_start, row_stop)`` of dim 0, written by ``rank``."""

    rank: int
    row_start: int
    row_stop: int


def chunk_runs(
    shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> list[Run]:
    """The runs of consecutive global elements that chunk ``(offsets, sizes)`` covers.

    Runs come in the chunk's own row-major order, so ``chunk_start`` grows by each run's length.
    The trailing dims the chunk spans fully merge into each run: an FSDP2 dim-0 shard is one run,
    a column block of a matrix is one run per row.

    Raises:
        LayoutMismatchError: the box has another rank than the tensor or leaves its bounds.
    """
    if not (len(shape) == len(offsets) == len(sizes)):
        raise LayoutMismatchError(
            f"a chunk of rank {len(sizes)} (offsets {list(offsets)}) does not fit a tensor of "
            f"shape {list(shape)}."
        )
    for dim, (extent, low, size) in enumerate(zip(shape, offsets, sizes, strict=True)):
        if low < 0 or size < 0 or low + size > extent:
            raise LayoutMismatchError(
                f"a chunk spans [{low}, {low + size}) of dim {dim}, outside the tensor's "
                f"shape {list(shape)}."
            )
    if prod(sizes) == 0:
        return []
    if not shape:
        return [Run(0, 0, 1)]
    # k: the last dim the chunk does not span fully (every dim after it is spanned fully).
    k = len(shape) - 1
    while k > 0 and offsets[k] == 0 and sizes[k] == shape[k]:
        k -= 1
    strides = [prod(shape[d + 1 :]) for d in range(len(shape))]
    length = sizes[k] * strides[k]
    runs: list[Run] = []
    position = 0
    for index in itertools.product(*(range(sizes[d]) for d in range(k))):
        start = sum((offsets[d] + i) * strides[d] for d, i in enumerate(index))
        runs.append(Run(start + offsets[k] * strides[k], position, length))
        position += length
    return runs


def row_chunks(shape: tuple[int, ...], world_size: int, max_elements: int) -> list[RowChunk]:
    """Cut a tensor the way FSDP2 shards it, each rank's rows cut again into bounded pieces.

    Rank ``r`` of ``world_size`` holds rows ``[r*c, min(d0, (r+1)*c))`` with
    ``c = ceil(d0 / world_size)`` (empty for trailing ranks when ``d0 < world_size``); its rows
    are written as consecutive pieces of at most ``max(1, max_elements // row_elements)`` rows.
    A 0-d tensor is one piece written by rank 0; empty pieces are left out.
    """
    if world_size < 1 or max_elements < 1:
        raise ValueError("world_size and max_elements must be at least 1")
    if not shape:
        return [RowChunk(0, 0, 1)]
    rows = shape[0]
    row_elements = prod(shape[1:])
    if rows == 0 or row_elements == 0:
        return []
    per_rank = ceil(rows / world_size)
    step = max(1, max_elements // row_elements)
    pieces: list[RowChunk] = []
    for rank in range(world_size):
        low, high = rank * per_rank, min(rows, (rank + 1) * per_rank)
        for start in range(low, high, step):
            pieces.append(RowChunk(rank, start, min(high, start + step)))
    return pieces
