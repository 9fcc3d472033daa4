"""Chunk and shard shapes are flat-contiguous (box chunks: whole rows of them) and consistent."""

from __future__ import annotations

from math import prod

import pytest

from ucformat.layout.chunking import (
    ChunkPolicy,
    box_chunk_shape,
    choose_chunking,
    flat_block_shape,
    is_flat_chunking,
)


def is_flat_contiguous(block: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """(1, ..., 1, k, d_{j+1}, ...): ones, then one cut dim, then whole (or overhanging) dims."""
    cut = next((i for i, b in enumerate(block) if b != 1), len(block))
    return all(b >= d for b, d in zip(block[cut + 1 :], shape[cut + 1 :], strict=True))


@pytest.mark.parametrize(
    "shape", [(10,), (100, 10), (4096, 5120), (50257, 768), (7, 3, 5), (3,), (1,), (1000003,)]
)
@pytest.mark.parametrize("policy", [ChunkPolicy(), ChunkPolicy(1024, 8192), ChunkPolicy(64, 64)])
def test_chunking_invariants(shape: tuple[int, ...], policy: ChunkPolicy) -> None:
    chunking = choose_chunking(shape, 4, policy)
    chunk, shard = chunking.chunk_shape, chunking.shard_shape
    assert len(chunk) == len(shard) == len(shape)
    assert all(s % c == 0 for s, c in zip(shard, chunk, strict=True))
    box = box_chunk_shape(shape, 4, policy)
    assert is_flat_contiguous(chunk, shape) == (box is None or box[0] == 1)
    assert is_flat_chunking(shape, chunk) == is_flat_contiguous(chunk, shape)
    if box is not None:
        assert chunk == box and chunk[1] <= -(-shape[1] // policy.tp_max)
    if box is not None and box[0] > 1:  # whole rows of box chunks
        assert chunk[1] == -(-shape[1] // policy.tp_max) and shard[1] >= shape[1]
    assert is_flat_contiguous(tuple(min(s, d) for s, d in zip(shard, shape, strict=True)), shape)
    assert prod(chunk) <= max(1, policy.chunk_bytes // 4)
    assert prod(shard) >= prod(chunk)


def test_chunk_targets() -> None:
    assert flat_block_shape((4096, 5120), 16384) == (3, 5120)
    assert flat_block_shape((10, 20000), 8192) == (1, 6667)
    assert flat_block_shape((5, 5), 100) == (5, 5)
    assert choose_chunking((), 4, ChunkPolicy()).chunk_shape == ()
    assert choose_chunking((0, 4), 4, ChunkPolicy()).chunk_shape == (1, 4)


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        ChunkPolicy(chunk_bytes=10, shard_bytes=5)


@pytest.mark.parametrize(
    ("shape", "chunk"),
    [  # docs/benchmarks.md, the box chunks of the simulated table
        ((4096, 4096), (8, 512)),
        ((11008, 4096), (4, 512)),  # 22 rows would read 1.5x at tp 8 x dp 64 (uneven pieces)
        ((4096, 11008), (8, 1376)),
        ((28672, 8192), (14, 1024)),
        ((8192, 28672), (4, 3584)),
        ((1024, 256), (32, 32)),  # small matrices: at least 4 KiB
        ((256, 1024), (8, 128)),
        ((64, 1 << 20), (1, 16384)),  # a TP slice's row is over 64 KiB: row pieces
    ],
)
def test_box_chunks(shape: tuple[int, int], chunk: tuple[int, int]) -> None:
    chunking = choose_chunking(shape, 4, ChunkPolicy())
    assert chunking.chunk_shape == chunk
    assert chunking.shard_shape[1] >= shape[1] and chunking.shard_shape[0] % chunk[0] == 0
    assert prod(chunking.shard_shape) * 4 <= 16 << 20


def test_box_chunks_only_where_asked() -> None:
    assert box_chunk_shape((1024, 255), 4, ChunkPolicy()) is None  # under 1 MiB
    assert box_chunk_shape((4096, 4096), 4, ChunkPolicy(tp_max=1)) is None
    assert box_chunk_shape((1 << 20,), 4, ChunkPolicy()) is None
    assert box_chunk_shape((4096, 4096), 4, ChunkPolicy(tp_max=4)) == (16, 1024)
    assert choose_chunking((4096, 4096), 4, ChunkPolicy(tp_max=1)).chunk_shape == (4, 4096)
