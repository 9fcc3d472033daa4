"""The readers' own shard keys are the keys zarr writes for every kind of ucformat array."""

from __future__ import annotations

import itertools

import pytest
from zarr.storage import MemoryStore

from ucformat.format.models import ArrayRef
from ucformat.format.spec import shard_object_key, state_array_path
from ucformat.layout.chunking import ChunkPolicy, choose_chunking
from ucformat.layout.grid import shard_grid
from ucformat.store.arrays import chunk_key, create_array


@pytest.mark.parametrize("shape", [(), (7,), (300, 5), (4, 3, 70)])
def test_shard_object_key_matches_zarr(shape: tuple[int, ...]) -> None:
    policy = ChunkPolicy(chunk_bytes=64, shard_bytes=256)
    chunking = choose_chunking(list(shape), 4, policy)
    numel = 1
    for dim in shape:
        numel *= dim
    ref = ArrayRef(
        path=state_array_path("layers.0.weight", "exp_avg"), dtype="float32", shape=list(shape),
        chunk_shape=list(chunking.chunk_shape), shard_shape=list(chunking.shard_shape),
        nbytes=numel * 4,
    )  # fmt: skip
    array = create_array(MemoryStore(), ref)
    coords = list(shard_grid(ref.shape, ref.shard_shape))
    assert coords
    for shard in itertools.islice(coords, 50):
        assert shard_object_key(ref.path, shard) == chunk_key(array, shard)
