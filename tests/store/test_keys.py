"""The readers' own shard keys are the keys zarr writes for every kind of ucformat array."""

from __future__ import annotations

import itertools

import pytest
from zarr.storage import MemoryStore

from ucformat.format.spec import stack_array_path, state_array_path
from ucformat.format.stacks import StoredArray
from ucformat.layout.chunking import ChunkPolicy, choose_chunking
from ucformat.layout.grid import shard_grid
from ucformat.store.arrays import chunk_key, create_array


@pytest.mark.parametrize("stacked", [False, True], ids=["format-3.0", "stack"])
@pytest.mark.parametrize("shape", [(), (7,), (300, 5), (4, 3, 70)])
def test_shard_object_key_matches_zarr(shape: tuple[int, ...], stacked: bool) -> None:
    """Format 3.0's arrays: ``<path>/c/i/j``; format 3.1's stacks: ``stacks/<n>/c.q.i.j``."""
    policy = ChunkPolicy(chunk_bytes=64, shard_bytes=256)
    chunking = choose_chunking(list(shape), 4, policy)
    if stacked:
        ref = StoredArray(
            stack_array_path(12), "float32", (3, *shape), (1, *chunking.chunk_shape),
            (2, *chunking.shard_shape), "none", ".",
        )  # fmt: skip
    else:
        ref = StoredArray(
            state_array_path("layers.0.weight", "exp_avg"), "float32", shape,
            chunking.chunk_shape, chunking.shard_shape,
        )  # fmt: skip
    array = create_array(MemoryStore(), ref)
    coords = list(shard_grid(ref.shape, ref.shard_shape))
    assert coords
    for shard in itertools.islice(coords, 50):
        key = ref.shard_key(shard)
        assert key == chunk_key(array, shard)
        assert ("/c." in key) == stacked and ("/c/" in key or key.endswith("/c")) != stacked
