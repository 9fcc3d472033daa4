"""The load simulator agrees with a brute-force count of chunks and shard indexes per rank."""

from __future__ import annotations

import itertools
import random
from math import prod

import pytest

from ucformat.layout.chunking import ChunkPolicy, choose_chunking
from ucformat.layout.partition import PartitionedFlatLayout, PerParamLayout
from ucformat.layout.reads import CRC_BYTES, INDEX_ENTRY_BYTES
from ucformat.layout.simulate import simulate_load


def _brute_force(
    params: list[tuple[str, tuple[int, ...]]],
    world_size: int,
    stage: int,
    policy: ChunkPolicy,
    groups: list[list[str]] | None,
) -> tuple[int, int, int]:
    """(needed, data, index) bytes by enumerating every element each rank owns."""
    shapes = dict(params)
    numels = {name: prod(shape) for name, shape in params}
    if stage == 3:
        layouts = [PerParamLayout.build([(n, numels[n]) for n, _ in params], world_size)]
    else:
        layouts = [
            PartitionedFlatLayout.build([(n, numels[n]) for n in group], world_size)
            for group in (groups or [[n for n, _ in params]])
        ]
    data = index = 0
    for layout, rank in itertools.product(layouts, range(world_size)):
        chunks: set[tuple[str, tuple[int, ...]]] = set()
        shards: set[tuple[str, tuple[int, ...]]] = set()
        for fragment in layout.fragments(rank):
            shape = shapes[fragment.name]
            chunking = choose_chunking(shape, 4, policy)
            for flat in range(fragment.param_start, fragment.param_stop):
                coords, rest = [], flat
                for dim in reversed(shape):
                    coords.append(rest % dim)
                    rest //= dim
                coords.reverse()
                chunk = tuple(c // k for c, k in zip(coords, chunking.chunk_shape, strict=True))
                shard = tuple(c // s for c, s in zip(coords, chunking.shard_shape, strict=True))
                chunks.add((fragment.name, chunk))
                if (fragment.name, shard) not in shards:  # each rank caches shard indexes
                    shards.add((fragment.name, shard))
                    per_shard = prod(
                        s // k
                        for s, k in zip(chunking.shard_shape, chunking.chunk_shape, strict=True)
                    )
                    index += INDEX_ENTRY_BYTES * per_shard + CRC_BYTES
        for name, _ in chunks:
            data += prod(choose_chunking(shapes[name], 4, policy).chunk_shape) * 4 + CRC_BYTES
    return 4 * sum(numels.values()), data, index


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("stage", [1, 3])
def test_simulation_matches_brute_force(seed: int, stage: int) -> None:
    rng = random.Random(seed)
    params = [
        (f"p{i}", tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3))))
        for i in range(rng.randint(1, 5))
    ]
    names = [name for name, _ in params]
    cut = rng.randint(0, len(names))
    groups = [g for g in (names[:cut], names[cut:]) if g]
    chunk = rng.choice([4, 8, 12, 32])
    policy = ChunkPolicy(chunk, chunk * rng.randint(1, 6))
    world_size = rng.randint(1, 6)
    sim = simulate_load(params, world_size, stage, policy, groups=groups)
    needed, data, index = _brute_force(params, world_size, stage, policy, groups)
    assert (sim.needed, sim.data, sim.index) == (needed, data, index)


def test_one_rank_reading_whole_chunks_has_no_amplification_but_the_index() -> None:
    # 4 x 8 fp32, chunks of one row (32 bytes), shards of two rows; W = 2 under ZeRO-3 gives
    # each rank two whole rows (one shard): 2 chunks + crcs, plus one 36-byte index.
    sim = simulate_load([("w", (4, 8))], 2, 3, ChunkPolicy(chunk_bytes=32, shard_bytes=64))
    assert (sim.needed, sim.data, sim.index) == (128, 2 * 2 * 36, 2 * 36)


def test_same_shape_params_are_simulated_once_with_the_same_result() -> None:
    policy = ChunkPolicy(64, 256)
    one = simulate_load([("a", (7, 9))], 4, 3, policy)
    many = simulate_load([(f"l{i}", (7, 9)) for i in range(5)], 4, 3, policy)
    assert (many.needed, many.data, many.index) == (5 * one.needed, 5 * one.data, 5 * one.index)
