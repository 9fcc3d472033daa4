"""Shard layout and encoding: Morton order, chunk placement, and bytes equal to zarr's."""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import pytest
from zarr.core.indexing import morton_order_iter
from zarr.storage import MemoryStore

from ucformat.format.stacks import StoredArray
from ucformat.layout.chunking import Chunking, ChunkPolicy, choose_chunking
from ucformat.layout.shards import box_runs, morton_order, shard_layout
from ucformat.layout.stacking import arrays_per_shard
from ucformat.sources.base import SourceFragment
from ucformat.store.arrays import chunk_key, create_array, write_region
from ucformat.store.keys import read_key
from ucformat.write.plan import _units
from ucformat.write.shard_encode import encode_shard, stream_shard


@pytest.mark.parametrize("grid", [(1,), (7,), (2, 2), (3, 5), (5, 1), (1, 6), (4, 1, 3), (2, 3, 4)])
def test_morton_order_is_zarrs(grid: tuple[int, ...]) -> None:
    assert morton_order(grid) == list(morton_order_iter(grid))


def test_layout_skips_chunks_outside_the_array() -> None:
    # format.md §2.2's example: shard (2, 6) of chunks (1, 3) in an array (3, 5)
    layout = shard_layout((3, 5), (1, 3), (2, 6), 4, (1, 0))
    assert [(s.local, s.flat_start, s.length) for s in layout.slots] == [
        ((0, 0), 10, 3),
        ((0, 1), 13, 2),
    ]
    assert layout.chunks_per_shard == (2, 2)
    assert layout.nbytes == 2 * (12 + 4) + 4 * 16 + 4


def test_box_chunks_are_runs_of_rows() -> None:
    # a box chunk (2, 2) of a (4, 4) array: one run per row, each at its row of the chunk
    layout = shard_layout((4, 4), (2, 2), (4, 4), 4, (0, 0))
    assert not any(s.contiguous or s.runs for s in layout.slots)
    assert [(s.local, box_runs((4, 4), (2, 2), s.box)) for s in layout.slots] == [
        ((0, 0), ((0, 0, 2), (4, 2, 2))),
        ((1, 0), ((8, 0, 2), (12, 2, 2))),
        ((0, 1), ((2, 0, 2), (6, 2, 2))),
        ((1, 1), ((10, 0, 2), (14, 2, 2))),
    ]
    # an edge box chunk clipped by the array keeps its stored row pitch
    edge = shard_layout((3, 5), (2, 3), (4, 6), 4, (0, 0))
    assert [box_runs((3, 5), (2, 3), s.box) for s in edge.slots] == [
        ((0, 0, 3), (5, 3, 3)), ((10, 0, 3),), ((3, 0, 2), (8, 3, 2)), ((13, 0, 2),)
    ]  # fmt: skip


@dataclass(frozen=True)
class _MemoryTensor:
    """Stands in for a TensorRef: a flat numpy array read through byte views."""

    values: np.ndarray

    def is_contiguous(self) -> bool:
        return True

    def read_scattered(self, start: int, views: list[memoryview]) -> None:
        raw = memoryview(self.values).cast("B")
        at = start * self.values.itemsize
        for view in views:
            view[:] = raw[at : at + len(view)]
            at += len(view)


def _random_case(rng: random.Random) -> tuple[tuple[int, ...], str, ChunkPolicy]:
    shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
    dtype = rng.choice(["float32", "bfloat16", "int64", "uint8"])
    chunk = rng.randint(1, 64)
    if rng.random() < 0.5:  # box chunks (2-D arrays of at least one byte, tp_max columns)
        tp_max, dp_max = rng.randint(2, 4), rng.randint(1, 3)
        return shape, dtype, ChunkPolicy(chunk, chunk * rng.randint(1, 12), tp_max, dp_max, 1)
    return shape, dtype, ChunkPolicy(chunk, chunk * rng.randint(1, 12))


def _stored(
    shape: tuple[int, ...], dtype: str, chunking: Chunking, stack: int = 0, per_shard: int = 1
) -> StoredArray:
    """The stored array of one logical array (``stack = 0``), or of a stack of ``stack`` of
    them, ``per_shard`` per shard object (docs/format.md §2.5)."""
    if not stack:
        return StoredArray("a", dtype, shape, chunking.chunk_shape, chunking.shard_shape)
    return StoredArray(
        "a", dtype, (stack, *shape), (1, *chunking.chunk_shape),
        (per_shard, *chunking.shard_shape), "none", ".",
    )  # fmt: skip


@pytest.mark.parametrize("live", [False, True], ids=["file-like", "live-memory"])
@pytest.mark.parametrize("seed", range(6))
def test_encoded_shards_equal_zarr_writes(seed: int, live: bool) -> None:
    """Also from a live save's :class:`MemoryTensor`, whose box chunks are cut straight out of
    its memory (no staging band); and of stacks (format 3.1: several logical arrays, one or
    several per shard object, ``.`` keys)."""
    from ucformat.sources.live import MemoryTensor

    rng = random.Random(seed)
    storage = {"float32": "<f4", "bfloat16": "<u2", "int64": "<i8", "uint8": "u1"}
    for _ in range(40):
        shape, dtype, policy = _random_case(rng)
        size = np.dtype(storage[dtype]).itemsize
        chunking = choose_chunking(shape, size, policy)
        stack = rng.choice([0, 1, rng.randint(2, 7)])
        per_shard = arrays_per_shard(
            stack, shape, chunking.chunk_shape, chunking.shard_shape, size, policy.shard_bytes
        )
        ref = _stored(shape, dtype, chunking, stack, per_shard)
        values = np.arange(prod(ref.shape)).astype(storage[dtype])
        cut = sorted(rng.sample(range(1, values.size), min(3, values.size - 1)))
        bounds = [0, *cut, values.size]
        tensor: Any = (
            MemoryTensor(values.view(np.uint8), dtype, 0) if live else _MemoryTensor(values)
        )
        fragments = [SourceFragment(tensor, a, a, b - a) for a, b in itertools.pairwise(bounds)]
        store = MemoryStore()
        array = create_array(store, ref)
        for unit in _units(0, ref, fragments):
            coords, encoded = encode_shard(ref, unit)
            region = values.reshape(ref.shape)[unit.region]
            write_region(array, unit.region, region)
            expected = read_key(store, chunk_key(array, coords))
            assert encoded.tobytes() == expected, (ref, policy, coords)


@pytest.mark.parametrize("window", [1, 40, 1 << 20])
def test_streamed_shards_equal_encoded_shards(tmp_path: Any, window: int) -> None:
    rng = random.Random(window)
    for trial in range(30):
        shape, dtype, policy = _random_case(rng)
        values = np.arange(prod(shape)).astype(
            {"float32": "<f4", "bfloat16": "<u2", "int64": "<i8", "uint8": "u1"}[dtype]
        )
        chunking = choose_chunking(shape, values.itemsize, policy)
        ref = _stored(shape, dtype, chunking)
        tensor: Any = _MemoryTensor(values)
        fragments = [SourceFragment(tensor, 0, 0, values.size)]
        for unit in _units(0, ref, fragments):
            _, encoded = encode_shard(ref, unit)
            path = tmp_path / f"{trial}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                size = stream_shard(fd, ref, unit, memoryview(bytearray(window)))
            finally:
                os.close(fd)
            assert size == len(encoded)
            assert path.read_bytes() == encoded.tobytes()


@pytest.mark.parametrize("live", [False, True], ids=["file-like", "live-memory"])
@pytest.mark.parametrize(
    ("shape", "chunk", "shard_rows", "window"),
    [
        ((100, 37), (3, 4), 30, 1 << 20),  # 340 chunks: several copy batches, edges both ways
        ((100, 37), (3, 4), 99, 700),  # windows of 8 chunks (Morton blocks), a 1-row shard
        ((96, 64), (6, 8), 48, 1 << 20),  # no edge chunk at all
        ((257, 12), (16, 12), 64, 4000),  # whole-width chunks, an edge row of chunks
    ],
)
def test_larger_box_shards_equal_zarr_writes(
    tmp_path: Any, shape: tuple[int, int], chunk: tuple[int, int], shard_rows: int,
    window: int, live: bool,
) -> None:  # fmt: skip
    """Box chunks cut from matrices with hundreds of chunks per shard (the encoder copies whole
    chunks in batches and edge chunks one by one), streamed through windows: zarr's bytes."""
    from ucformat.sources.live import MemoryTensor

    values = (np.arange(prod(shape), dtype=np.int64) * 7919 % 65521).astype("<f4")
    shard = (shard_rows, shape[1] + (-shape[1]) % chunk[1])
    ref = StoredArray("a", "float32", shape, chunk, shard)
    tensor: Any = (
        MemoryTensor(values.view(np.uint8), "float32", 0) if live else _MemoryTensor(values)
    )
    split = [0, values.size // 3, values.size]  # two fragments: a band may span both
    fragments = [SourceFragment(tensor, a, a, b - a) for a, b in itertools.pairwise(split)]
    store = MemoryStore()
    array = create_array(store, ref)
    units = list(_units(0, ref, fragments))
    assert units
    for number, unit in enumerate(units):
        coords, encoded = encode_shard(ref, unit)
        write_region(array, unit.region, values.reshape(shape)[unit.region])
        expected = read_key(store, chunk_key(array, coords))
        assert encoded.tobytes() == expected, coords
        path = tmp_path / f"{number}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            stream_shard(fd, ref, unit, memoryview(bytearray(window)))
        finally:
            os.close(fd)
        assert path.read_bytes() == expected, coords
