"""Shards the converter encodes itself are byte for byte what zarr writes for the same data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from zarr.storage import LocalStore, MemoryStore

import ucformat
from ucformat.format.stacks import placement, stored_array
from ucformat.store.arrays import array_from_manifest, chunk_key, create_array, write_region
from ucformat.store.keys import read_key
from ucformat.write.plan import shard_regions

DATA = Path(__file__).resolve().parents[2] / "fixtures" / "data"


@pytest.mark.parametrize(
    ("case", "chunk_bytes", "shard_bytes"),
    [
        ("z2-fp32-dsadam-ftb-ws3", 64, 256),  # overhanging shards, 2-d chunk grids per shard
        ("z3-bf16-dsadam-ftb-ws4", 40, 40),  # one chunk per shard, rows cut into parts
        ("z1-bf16-dsadam-simple-ws2", 24, 200),  # bf16 stored as uint16, int64 buffers
        ("z3-fp16-tadam-multi-ws2", 1024, 4096),  # whole arrays in one chunk
    ],
)
def test_encoded_shards_equal_zarr_writes(
    tmp_path: Path, case: str, chunk_bytes: int, shard_bytes: int
) -> None:
    manifest = ucformat.convert(
        DATA / case / "ckpt", tmp_path / "s", chunk_bytes=chunk_bytes, shard_bytes=shard_bytes
    )
    ours = LocalStore(tmp_path / "s", read_only=True)
    refs = [ref for _, ref in manifest.arrays()]
    stored = {stored_array(ref) for ref in refs}  # the stacks: 0-d arrays stacked too
    shards = 0
    for array in stored:
        if not all(array.shape):
            continue
        values = np.asarray(array_from_manifest(ours, array)[...])
        zarr_store = MemoryStore()
        theirs = create_array(zarr_store, array)
        for region in shard_regions(list(array.shape), list(array.shard_shape)):
            write_region(theirs, region, values[region])
            coords = tuple(p.start // s for p, s in zip(region, array.shard_shape, strict=True))
            key = chunk_key(theirs, coords)
            assert read_key(ours, key) == read_key(zarr_store, key), (array.path, coords)
            shards += 1
    assert shards >= len(stored)
    assert any(ref.stack and ref.stack.per_shard > 1 for ref in refs)  # shared shards too


def test_fast_reads_equal_zarr_reads(tmp_path: Path) -> None:
    """The reader's direct shard reads give zarr's values and fetch zarr's bytes."""
    import random

    from ucformat.format.dtypes import numpy_storage_dtype
    from ucformat.layout.chunking import chunk_aligned_range
    from ucformat.layout.ranges import flat_range_to_boxes
    from ucformat.store.arrays import read_box
    from ucformat.store.direct.shard_read import read_flat_range

    ucformat.convert(
        DATA / "z3-bf16-dsadam-ftb-ws4" / "ckpt", tmp_path / "s", chunk_bytes=24, shard_bytes=96
    )
    rng = random.Random(1)
    fast = ucformat.open(tmp_path / "s")
    slow = ucformat.open(tmp_path / "s")
    refs = [s for p in fast.manifest.params.values() for s in p.states.values() if s.shape]
    for _ in range(60):
        ref, offset = placement(rng.choice(refs))  # the stack, and where the array lies in it
        numel = int(np.prod(ref.shape[1:]))
        start = offset + rng.randrange(numel)
        stop = rng.randint(start + 1, offset + numel)
        out = np.empty(stop - start, dtype=numpy_storage_dtype(ref.dtype))
        array = fast._array(ref)
        assert read_flat_range(
            fast.store, ref, lambda shard, a=array: chunk_key(a, shard), start, stop, out
        ).ok
        low, high = chunk_aligned_range(ref.shape, ref.chunk_shape, start, stop)
        values = np.concatenate(
            [read_box(slow._array(ref), box).reshape(-1)
             for box in flat_range_to_boxes(ref.shape, low, high)]
        )  # fmt: skip
        assert np.array_equal(out, values[start - low : stop - low])
    assert fast.stats.bytes_read <= slow.stats.bytes_read
