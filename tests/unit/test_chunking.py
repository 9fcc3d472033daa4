"""Chunk and shard shapes are flat-contiguous and consistent."""

from __future__ import annotations

from math import prod

import pytest

from ucformat.layout.chunking import ChunkPolicy, choose_chunking, flat_block_shape


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
    assert is_flat_contiguous(chunk, shape)
    assert is_flat_contiguous(shard, shape)
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
