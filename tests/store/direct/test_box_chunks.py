"""Box chunks (docs/format.md §2.2): shards written as zarr writes them, every read path gives
zarr's values, and the bytes and requests fetched are those the cost model predicts."""

from __future__ import annotations

import itertools
import random
from math import prod
from pathlib import Path

import numpy as np
import pytest
from zarr.storage import LocalStore, MemoryStore

import ucformat
from tests.helpers import logical_values, read_cost, shard_key
from ucformat.format.models import ArrayRef
from ucformat.format.stacks import stored_array
from ucformat.layout.boxes import Run
from ucformat.layout.chunking import ChunkPolicy, chunk_aligned_range, is_flat_chunking
from ucformat.layout.placements import local_runs
from ucformat.layout.ranges import chunk_cover, flat_range_to_boxes, union_cover
from ucformat.layout.reads import range_read_cost, runs_read_cost
from ucformat.sources.detect import read_source
from ucformat.store.arrays import array_from_manifest, chunk_key, create_array, write_region
from ucformat.store.keys import open_store, read_key
from ucformat.store.lifecycle import start_store
from ucformat.store.manifest_io import commit_manifest
from ucformat.write.execute import create_arrays, write_units
from ucformat.write.plan import ConvertOptions, plan_convert, shard_regions

DATA = Path(__file__).resolve().parents[2] / "fixtures" / "data"
CASE = "z2-fp32-dsadam-ftb-ws3"


def _brute_chunks(
    shape: tuple[int, ...], chunk: tuple[int, ...], ranges: list[tuple[int, int]]
) -> set[tuple[int, ...]]:
    found = set()
    for start, stop in ranges:
        for index in range(start, stop):
            coords = np.unravel_index(index, shape)
            found.add(tuple(int(c) // k for c, k in zip(coords, chunk, strict=True)))
    return found


@pytest.mark.parametrize("seed", range(4))
def test_cover_and_cost_count_exactly_the_chunks_touched(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
        chunk = tuple(rng.randint(1, d + 1) for d in shape)
        shard = tuple(c * rng.randint(1, 3) for c in chunk)
        numel = prod(shape)
        ranges = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(numel)
            ranges.append((start, rng.randint(start + 1, numel)))
        want = _brute_chunks(shape, chunk, ranges)
        cover = chunk_cover(shape, chunk, ranges)
        got = [
            cell
            for box in cover
            for cell in itertools.product(
                *(
                    range(p.start // k, (p.stop - 1) // k + 1)
                    for p, k in zip(box, chunk, strict=True)
                )
            )
        ]
        assert sorted(got) == sorted(want), (shape, chunk, ranges)  # disjoint, exact
        cost = range_read_cost(shape, chunk, shard, 4, ranges)
        assert cost.chunks == len(want), (shape, chunk, shard, ranges)
        if is_flat_chunking(shape, chunk):
            low, high = chunk_aligned_range(shape, chunk, *ranges[0])
            assert _brute_chunks(shape, chunk, [(low, high)]) == _brute_chunks(
                shape, chunk, [ranges[0]]
            )


def test_union_cover_is_disjoint_and_exact() -> None:
    rng = random.Random(5)
    for _ in range(100):
        rects = [
            tuple((lo, lo + rng.randint(1, 4)) for lo in (rng.randint(0, 5), rng.randint(0, 5)))
            for _ in range(rng.randint(1, 5))
        ]
        cells = {c for r in rects for c in itertools.product(*(range(a, b) for a, b in r))}
        got = [
            c for r in union_cover(rects) for c in itertools.product(*(range(a, b) for a, b in r))
        ]
        assert sorted(got) == sorted(cells)


#: Box chunks on the fixture's small matrices: 2 columns of chunks, rows of 2.
BOX = ChunkPolicy(chunk_bytes=64, shard_bytes=512, tp_max=2, dp_max=4, box_min_bytes=1)


def _write(
    dst: Path, policy: ChunkPolicy, compressor: str = "none"
) -> ucformat.UniversalCheckpoint:
    with read_source(DATA / CASE / "ckpt") as source:
        plan = plan_convert(source, ConvertOptions(policy=policy, compressor=compressor))
        store = open_store(dst, read_only=False)
        start_store(store, False, plan.manifest.format_version)
        arrays = create_arrays(store, plan)
        write_units(plan, arrays, plan.units, workers=2)
        commit_manifest(store, plan.manifest)
    return ucformat.open(dst)


def _refs(ckpt: ucformat.UniversalCheckpoint) -> list[tuple[str, str, ArrayRef]]:
    """(parameter, state, ref) of every state with at least one dimension."""
    return [
        (name, state, ref)
        for name, entry in ckpt.manifest.params.items()
        for state, ref in entry.states.items()
        if ref.shape
    ]


def _boxed(ckpt: ucformat.UniversalCheckpoint) -> list[tuple[str, str, ArrayRef]]:
    return [
        item for item in _refs(ckpt) if not is_flat_chunking(item[2].shape, item[2].chunk_shape)
    ]


def test_box_shards_equal_zarr_writes(tmp_path: Path) -> None:
    ckpt = _write(tmp_path / "s", BOX)
    ours = LocalStore(tmp_path / "s", read_only=True)
    boxed = sum(not is_flat_chunking(ref.shape, ref.chunk_shape) for _, _, ref in _refs(ckpt))
    stored = {stored_array(ref) for _, _, ref in _refs(ckpt)}
    for array in stored:  # every stack, as zarr writes it
        values = np.asarray(array_from_manifest(ours, array)[...])
        zarr_store = MemoryStore()
        theirs = create_array(zarr_store, array)
        for region in shard_regions(list(array.shape), list(array.shard_shape)):
            write_region(theirs, region, values[region])
            coords = tuple(p.start // s for p, s in zip(region, array.shard_shape, strict=True))
            key = chunk_key(theirs, coords)
            assert read_key(ours, key) == read_key(zarr_store, key), (array.path, coords)
    assert boxed >= 3
    flat = _write(tmp_path / "flat", ChunkPolicy(64, 512))  # the same values, flat chunks
    for name, state, _ in _refs(ckpt):
        assert np.array_equal(ckpt.read(name, state).numpy(), flat.read(name, state).numpy())
    assert ucformat.verify(tmp_path / "s").ok


@pytest.mark.parametrize("compressor", ["none", "zstd"])
def test_box_reads_equal_zarr_and_cost_model(tmp_path: Path, compressor: str) -> None:
    ckpt = _write(tmp_path / "s", BOX, compressor)
    rng = random.Random(2)
    refs = _boxed(ckpt)
    for trial in range(40):
        name, state, ref = rng.choice(refs)
        whole = logical_values(ckpt.store, ref).reshape(-1)
        numel = whole.size
        fresh = ucformat.open(tmp_path / "s")  # fresh index cache
        before = (fresh.stats.bytes_read, fresh.stats.requests)
        if trial % 2:  # a flat range (a ZeRO partition)
            start = rng.randrange(numel)
            stop = rng.randint(start + 1, numel)
            got = fresh.read_range(name, state, start, stop)
            expected = whole[start:stop]
            cost = read_cost(ref, [(start, stop)])
        else:  # a DTensor local shard: a box as one run per row
            rows, cols = ref.shape
            r0, c0 = rng.randrange(rows), rng.randrange(cols)
            box = ((r0, rng.randint(r0 + 1, rows)), (c0, rng.randint(c0 + 1, cols)))
            runs = local_runs(tuple(ref.shape), tuple((iv,) for iv in box))
            got = fresh.read_runs(name, state, runs)
            expected = np.concatenate([whole[r.start : r.start + r.length] for r in runs])
            spans = [(r.start, r.start + r.length) for r in runs]
            cost = read_cost(ref, spans, runs=True)
        assert np.array_equal(got.numpy(), expected), (name, state, trial)
        if compressor == "none":
            assert fresh.stats.bytes_read - before[0] == cost.total, (name, state, trial)
            assert fresh.stats.requests - before[1] == cost.requests, (name, state, trial)


def test_box_runs_read_only_their_columns(tmp_path: Path) -> None:
    """A column half of a box-chunked matrix fetches about half of its chunks."""
    ckpt = _write(tmp_path / "s", BOX)
    _, _, ref = max(_boxed(ckpt), key=lambda item: prod(item[2].shape))
    rows, cols = ref.shape
    runs: list[Run] = local_runs(tuple(ref.shape), (((0, rows),), ((0, cols // 2),)))
    spans = [(r.start, r.start + r.length) for r in runs]
    half = runs_read_cost(ref.shape, ref.chunk_shape, ref.shard_shape, 4, spans)
    whole = range_read_cost(ref.shape, ref.chunk_shape, ref.shard_shape, 4, [(0, rows * cols)])
    assert half.data_bytes * 2 <= whole.data_bytes * 1.2
    assert len(flat_range_to_boxes(ref.shape, 0, rows * cols)) == 1


def test_row_parallel_fragments_read_their_columns(tmp_path: Path) -> None:
    """A DeepSpeed AutoTP row-parallel slice (one fragment per row) of a box-chunked matrix is
    read in one read of its chunks, straight into the flat partition (``read_flat_state``)."""
    from ucformat.layout.partition import Fragment
    from ucformat.read.partitions import FlatTarget, ReadTally, read_flat_state

    _write(tmp_path / "s", BOX)
    ckpt = ucformat.open(tmp_path / "s")
    name, _, ref = max(_boxed(ckpt), key=lambda item: prod(item[2].shape))
    rows, cols = ref.shape
    half = cols // 2
    fragments = [Fragment(name, 0, row * cols + half, 3 + row * (cols - half), cols - half)
                 for row in range(rows)]  # fmt: skip
    numel = 3 + rows * (cols - half)
    target = FlatTarget(0, 0, None, 0, numel)  # type: ignore[arg-type]
    tally = ReadTally()
    before = (ckpt.stats.bytes_read, ckpt.stats.requests)
    values = read_flat_state(ckpt, target, fragments, "fp32", tally).numpy()
    fetched = (ckpt.stats.bytes_read - before[0], ckpt.stats.requests - before[1])
    whole = ckpt.read(name, "fp32").numpy()
    assert np.array_equal(values[3:].reshape(rows, cols - half), whole[:, half:])
    assert not values[:3].any()
    planned = tally.planned()
    assert fetched == (planned.total, planned.requests)
    assert planned.data_bytes < 0.75 * ref.nbytes * (1 + 4 / prod(ref.chunk_shape))


def test_box_chunk_damage_is_an_error_naming_the_chunk(tmp_path: Path) -> None:
    from ucformat.errors import CorruptDataError

    ckpt = _write(tmp_path / "s", BOX)
    name, state, ref = _boxed(ckpt)[0]
    shard = tmp_path / "s" / shard_key(ref, (0, 0))
    data = bytearray(shard.read_bytes())
    data[5] ^= 0xFF  # inside the first stored chunk
    shard.write_bytes(bytes(data))
    fresh = ucformat.open(tmp_path / "s")
    with pytest.raises(CorruptDataError, match="chunk"):
        fresh.read(name, state)
    rows, cols = ref.shape
    runs = local_runs(tuple(ref.shape), (((0, rows),), ((0, cols),)))
    with pytest.raises(CorruptDataError, match="chunk"):
        fresh.read_runs(name, state, runs)
    assert not ucformat.verify(tmp_path / "s").ok


def test_flat_stores_read_as_before(tmp_path: Path) -> None:
    """A store with flat-contiguous chunks only (every store before box chunks; ``tp_max=1``)
    reads through the flat path: the runs' chunk-widened spans merged, the cost model's flat
    rule, the values of zarr."""
    ckpt = _write(tmp_path / "s", ChunkPolicy(64, 512, tp_max=1))
    refs = _refs(ckpt)
    assert all(is_flat_chunking(r.shape, r.chunk_shape) for _, _, r in refs)
    rng = random.Random(4)
    for name, state, ref in [item for item in refs if len(item[2].shape) == 2]:
        rows, cols = ref.shape
        c0 = rng.randrange(cols)
        runs = local_runs(tuple(ref.shape), (((0, rows),), ((c0, cols),)))
        fresh = ucformat.open(tmp_path / "s")
        before = (fresh.stats.bytes_read, fresh.stats.requests)
        got = fresh.read_runs(name, state, runs).numpy()
        fetched = (fresh.stats.bytes_read - before[0], fresh.stats.requests - before[1])
        whole = logical_values(fresh.store, ref)
        assert np.array_equal(got.reshape(rows, cols - c0), whole[:, c0:])
        spans = [(r.start, r.start + r.length) for r in runs]
        cost = read_cost(ref, spans, runs=True)
        assert fetched == (cost.total, cost.requests)
