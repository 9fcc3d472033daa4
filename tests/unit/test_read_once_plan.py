"""The read-once geometry and plan (layout/cells.py, layout/read_once.py) against brute force.

Arrays of many shapes and chunkings (flat chunks, split rows, box chunks of matrices, shards
that overhang), random needs: the cells a need touches equal the chunks of its elements; the
planned copies move every needed element exactly once, from where a reader staged it; the
homes' plan gives every needed cell one reader that needs part of its block, sends each cell
to every rank needing it and to no other, and does not depend on the order of the demands;
both ends of a pair cut their moves into the same rounds.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from ucformat.layout.cells import CellGrid, OutBox, cell_grid
from ucformat.layout.chunking import ChunkPolicy, choose_chunking
from ucformat.layout.read_once import (
    READ,
    RECV,
    SEND,
    BlockPolicy,
    Demand,
    pair_cap,
    plan_home,
    rank_demands,
    schedule,
)
from ucformat.layout.reads import chunk_rects_read_cost, range_read_cost

SHAPES = [(), (1,), (7,), (100,), (10, 4), (33, 20), (3, 5, 7), (64, 48), (40, 100), (96, 64)]
POLICIES = [
    ChunkPolicy(chunk_bytes=64, shard_bytes=256, box_min_bytes=1 << 30),
    ChunkPolicy(chunk_bytes=96, shard_bytes=1024, tp_max=4, box_min_bytes=256),
    ChunkPolicy(chunk_bytes=512, shard_bytes=2048, tp_max=8, dp_max=4, box_min_bytes=1024),
]


def _grids() -> list[CellGrid]:
    """Arrays as a store of format 3.0 holds them, and stacks of them (docs/format.md §2.5:
    ``(N, ..)`` in chunks ``(1, ..)``; ``K`` arrays per shard object where one shard holds a
    whole array), a stack of box-chunked matrices with whole-matrix shards among them."""
    out = []
    for shape, policy in itertools.product(SHAPES, POLICIES):
        chunking = choose_chunking(shape, 4, policy)
        out.append(cell_grid(shape, chunking.chunk_shape, chunking.shard_shape, 4))
        if shape:
            chunk, shard = chunking.chunk_shape, chunking.shard_shape
            out.append(cell_grid((3, *shape), (1, *chunk), (1, *shard), 4))
            if all(min(s, d) == d for s, d in zip(shard, shape, strict=True)):
                out.append(cell_grid((3, *shape), (1, *chunk), (2, *shard), 4))
    out.append(cell_grid((3, 10, 12), (1, 4, 5), (2, 12, 15), 4))
    return out


def _chunks_of(grid: CellGrid, elements: np.ndarray) -> set[int]:
    """Brute force: the cells holding flat ``elements`` (chunk coords, row-major id; for a box
    grid, its (row, col) in the chunk grid as one id)."""
    if not grid.shape:
        return {0}
    coords = np.unravel_index(elements, grid.shape)
    chunk = [c // k for c, k in zip(coords, grid.chunk_shape, strict=True)]
    extent = [math.ceil(d / k) for d, k in zip(grid.shape, grid.chunk_shape, strict=True)]
    return {int(i) for i in np.unique(np.ravel_multi_index(chunk, extent))}


def _cells(grid: CellGrid, rect: tuple[int, int, int, int]) -> set[int]:
    i0, i1, j0, j1 = rect
    return {i * grid.cols + j for i in range(i0, i1) for j in range(j0, j1)}


def _random_runs(rng: random.Random, numel: int) -> list[tuple[int, int, int]]:
    runs, at = [], 0
    for _ in range(rng.randint(1, 4)):
        start = rng.randrange(numel)
        stop = rng.randint(start + 1, numel)
        runs.append((start, stop, at))
        at += stop - start
    return runs


@pytest.mark.parametrize("grid", _grids(), ids=lambda g: f"{g.shape}-{g.chunk_shape}")
def test_cells_of_needs_and_copies(grid: CellGrid) -> None:
    rng = random.Random(hash((grid.shape, grid.chunk_shape)) & 0xFFFF)
    numel = grid.numel
    values = np.arange(numel, dtype=np.int64)
    for _ in range(20):
        runs = _random_runs(rng, numel)
        if grid.box and rng.random() < 0.5:  # a column block, one run per row
            cols = grid.shape[-1]
            rows = numel // cols  # a stack's matrices one after another
            x0 = rng.randrange(cols)
            x1 = rng.randint(x0 + 1, cols)
            y0 = rng.randrange(rows)
            y1 = rng.randint(y0 + 1, rows)
            width = x1 - x0
            runs = [(y * cols + x0, y * cols + x1, (y - y0) * width) for y in range(y0, y1)]
        needs = grid.out_boxes(runs) if grid.box else runs
        rects = grid.need_rects(needs)
        wanted = _chunks_of(grid, np.concatenate([np.arange(a, b) for a, b, _ in runs]))
        got = [_cells(grid, rect) for rect in rects]
        assert set().union(*got) == wanted
        assert sum(map(len, got)) == len(wanted)  # disjoint
        for rect in rects:  # each within one shard
            assert grid.shard_of(rect[0]) == grid.shard_of(rect[1] - 1)
        # the cells' chunks as chunk-grid rects, and a reader's cost of them as one read
        extent = [math.ceil(d / k) for d, k in zip(grid.shape, grid.chunk_shape, strict=True)]
        parts = [part for rect in rects for part in grid.chunk_rects(rect)]
        chunk_ids = {
            int(np.ravel_multi_index(cell, extent)) if grid.shape else 0
            for part in parts
            for cell in itertools.product(*(range(lo, hi) for lo, hi in part))
        }
        assert chunk_ids == wanted
        if grid.box:  # as a reader's block is costed (layout/read_once.reads_cost)
            block = [(a, b) for a, b, _ in grid.block_runs(rects)]
            layout = (grid.shape, grid.chunk_shape, grid.shard_shape, grid.itemsize)
            assert chunk_rects_read_cost(*layout, [parts]) == range_read_cost(
                *layout, block, together=True
            )
        # stage every rect as a reader would (region_runs), place it with the planned copies
        size = sum(stop - start for start, stop, _ in runs)
        out = np.full(size, -1, dtype=np.int64)
        placed = 0
        indexed = grid.index(needs)
        for rect in rects:
            staged = np.empty(grid.elements(rect), dtype=np.int64)
            for start, stop, at in grid.region_runs(rect, 0):
                staged[at : at + stop - start] = values[start:stop]
            for _, copy in grid.copies(rect, 0, indexed):
                for row in range(copy.rows):
                    src = copy.src + row * copy.src_stride
                    dst = copy.dst + row * copy.dst_stride
                    assert (out[dst : dst + copy.width] == -1).all()  # each element once
                    out[dst : dst + copy.width] = staged[src : src + copy.width]
                placed += copy.elements
        expected = np.concatenate([values[start:stop] for start, stop, _ in runs])
        assert placed == size
        assert (out == expected).all()


@pytest.mark.parametrize("grid", _grids(), ids=lambda g: f"{g.shape}-{g.chunk_shape}")
def test_shards_and_sub_rects(grid: CellGrid) -> None:
    """A cell row's shard is the cell rows with the same shard coordinates (a box grid: in
    every dimension but the last, which its shards hold whole)."""
    per = [s // c for s, c in zip(grid.shard_shape, grid.chunk_shape, strict=True)]
    extent = [math.ceil(d / k) for d, k in zip(grid.shape, grid.chunk_shape, strict=True)]
    if grid.box:
        assert grid.plannable
        per, extent = per[:-1], extent[:-1]
    if grid.shape and grid.numel:
        coords = np.unravel_index(np.arange(grid.rows), extent)
        keys = list(zip(*(c // p for c, p in zip(coords, per, strict=True)), strict=True))
        span: dict[tuple[int, ...], tuple[int, int]] = {}
        for cell, key in enumerate(keys):
            low, _ = span.get(key, (cell, cell))
            span[key] = (low, cell + 1)
        for cell, key in enumerate(keys):
            assert grid.shard_of(cell) == span[key]
    for start in range(0, grid.rows, max(1, grid.rows // 3)):
        lo, hi = grid.shard_of(start)
        rect = (lo, hi, 0, grid.cols)
        pieces = grid.sub_rects(rect, max(1, grid.nbytes(rect) // 3))
        assert sum(grid.elements(p) for p in pieces) == grid.elements(rect)
        offsets = [grid.offset_in(rect, p) for p in pieces]
        assert offsets == list(itertools.accumulate([0] + [grid.elements(p) for p in pieces[:-1]]))


def _job(rng: random.Random, world: int) -> tuple[dict[int, CellGrid], list[Demand]]:
    grids = dict(enumerate(_grids()[::3]))
    demands: list[Demand] = []
    for rank in range(world):
        needs = {}
        for array, grid in grids.items():
            if grid.numel == 0 or rng.random() < 0.3:
                continue
            kind = rng.random()
            if kind < 0.3:  # replicated
                needs[array] = [(0, grid.numel)]
            elif kind < 0.7:  # a ZeRO-3 piece
                piece = math.ceil(grid.numel / world)
                start = min(rank * piece, grid.numel)
                if start < min(start + piece, grid.numel):
                    needs[array] = [(start, min(start + piece, grid.numel))]
            else:
                needs[array] = [(a, b) for a, b, _ in _random_runs(rng, grid.numel)]
        demands += [d for _, d in rank_demands(rank, needs, grids, world)]
    return grids, demands


@pytest.mark.parametrize("seed", range(12))
def test_home_plan_reads_each_cell_once(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4, 7])
    policy = BlockPolicy(max_bytes=rng.choice([64, 512, 1 << 20]), min_bytes=rng.choice([0, 256]))
    grids, demands = _job(rng, world)
    plan = plan_home(demands, grids, policy, home=3)
    shuffled = demands[:]
    rng.shuffle(shuffled)
    assert plan_home(shuffled, grids, policy, home=3).rows == plan.rows
    needers: dict[tuple[int, int], set[int]] = {}
    for d in demands:
        for cell in _cells(grids[d.array], d.rect):
            needers.setdefault((d.array, cell), set()).add(d.rank)
    read: dict[tuple[int, int], int] = {}
    sent: dict[tuple[int, int], set[int]] = {}
    got: dict[tuple[int, int], set[int]] = {}
    blocks: dict[int, set[int]] = {}
    for rank, rows in plan.rows.items():
        for row in rows:
            cells = {(row.array, c) for c in _cells(grids[row.array], row.rect)}
            if row.kind == READ:
                assert row.peer == rank and row.block >> 32 == 3
                for cell in cells:
                    assert cell not in read
                    read[cell] = rank
                    blocks.setdefault(row.block, set()).update(needers[cell])
            elif row.kind == SEND:
                assert all(read.get(cell, rank) == rank for cell in cells)
                for cell in cells:
                    sent.setdefault(cell, set()).add(row.peer)
            else:
                assert row.kind == RECV and row.peer != rank
                for cell in cells:
                    got.setdefault(cell, set()).add(rank)
    assert set(read) == set(needers)
    for cell, ranks in needers.items():
        assert sent[cell] == ranks  # every rank that needs it, the reader included if it does
        assert got.get(cell, set()) == ranks - {read[cell]}
    for rank, rows in plan.rows.items():  # a reader needs some of each block it reads
        for row in rows:
            if row.kind == READ:
                assert rank in blocks[row.block]
    cells = sum(len(_cells(grids[d.array], d.rect)) for d in demands)
    assert plan.union_bytes <= plan.demanded_bytes and cells >= len(needers)


def test_both_ends_schedule_the_same_rounds() -> None:
    grids, demands = _job(random.Random(5), 4)
    plan = plan_home(demands, grids, BlockPolicy(max_bytes=256, min_bytes=0))
    sends: dict[tuple[int, int], list[tuple[int, tuple[int, int, int, int]]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, tuple[int, int, int, int]]]] = {}
    for rank, rows in plan.rows.items():
        for row in rows:
            if row.kind == SEND and row.peer != rank:
                sends.setdefault((rank, row.peer), []).append((row.array, row.rect))
            elif row.kind == RECV:
                recvs.setdefault((row.peer, rank), []).append((row.array, row.rect))
    assert set(sends) == set(recvs)
    for pair, atoms in sends.items():
        cap = pair_cap(1024, 3, 2)
        there = schedule(list(reversed(recvs[pair])), grids, cap)
        here = schedule(atoms, grids, cap)
        assert here == there
        rounds: dict[int, int] = {}
        for piece in here:
            rounds[piece.round] = rounds.get(piece.round, 0) + piece.nbytes
        grid_rows = max(
            grids[p.array].nbytes((p.rect[0], p.rect[0] + 1, *p.rect[2:])) for p in here
        )
        assert all(size <= max(cap, grid_rows) for size in rounds.values())


def test_boxes_and_runs_need_the_same_cells() -> None:
    grid = cell_grid((64, 48), (8, 6), (16, 48), 4)
    assert grid.box
    runs = [(y * 48 + 12, y * 48 + 30, (y - 5) * 18) for y in range(5, 40)]
    boxes = grid.out_boxes(runs)
    assert boxes == [OutBox(5, 40, 12, 30, 0, 18)]
    assert grid.need_rects(boxes) == [(0, 2, 2, 5), (2, 4, 2, 5), (4, 5, 2, 5)]


def test_which_grids_the_plan_describes() -> None:
    """Flat chunks, box-chunked matrices and stacks of them are planned; box chunks of a deeper
    shape (no writer of ucformat makes them) are left to each rank's own reads."""
    assert cell_grid((3, 10, 12), (1, 4, 5), (1, 8, 12), 4).plannable  # a stack of matrices
    assert cell_grid((10, 12), (4, 5), (8, 12), 4).plannable
    assert cell_grid((4, 6, 8), (1, 1, 8), (2, 6, 8), 4).plannable  # flat
    assert not cell_grid((4, 6, 8), (2, 3, 4), (2, 6, 8), 4).plannable
    assert not cell_grid((10, 12), (4, 5), (8, 5), 4).plannable  # shards split the columns
