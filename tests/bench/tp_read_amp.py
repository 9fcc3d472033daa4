"""Read amplification of tensor-parallel loads: row chunks, square tiles and box chunks.

For LLaMA-7B-like and 70B-like matrices split as TP (and FSDP2 + TP) does, the bytes one rank
fetches to read its box, over the bytes it needs (fp32), with three chunkings: flat-contiguous
64 KiB chunks (``ChunkPolicy(tp_max=1)``: whole rows or pieces of one row, the layout before box
chunks), square 128 x 128 tiles (64 KiB of fp32), and the store's default (``choose_chunking``:
box chunks of ``C / 8`` columns, docs/format.md §2.2). Data bytes only: shard indexes add the
same small fraction to all (docs/benchmarks.md, "Simulated scale").

Python: ``rows(...)``; command line: ``python -m tests.bench.tp_read_amp --markdown``. The
default column is the real read planner (``ucformat.layout.reads.runs_read_cost``, what the
loader's reads are checked against byte for byte); the row-chunk model is checked against it on
every small case it prints.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from ucformat.layout.chunking import ChunkPolicy, choose_chunking, chunk_aligned_range
from ucformat.layout.placements import Placement, local_box, local_intervals, local_runs, merge_runs
from ucformat.layout.reads import CRC_BYTES, range_read_cost, runs_read_cost

ITEM = 4
TILE = (128, 128)
#: name, shape, TP placement (colwise Shard(0) or rowwise Shard(1)).
MATRICES = (
    ("7B attn q (colwise)", (4096, 4096), 0),
    ("7B attn o (rowwise)", (4096, 4096), 1),
    ("7B mlp up (colwise)", (11008, 4096), 0),
    ("7B mlp down (rowwise)", (4096, 11008), 1),
    ("70B mlp up (colwise)", (28672, 8192), 0),
    ("70B mlp down (rowwise)", (8192, 28672), 1),
)


def _box(shape: Sequence[int], tp_dim: int, tp: int, dp: int, coord: tuple[int, int]) -> tuple:
    """The (dp, tp) rank's box: FSDP2 shards dim 0 over dp after TP (strided when tp_dim is 0)."""
    layout = [
        Placement("strided", 0, tp) if tp_dim == 0 else Placement("shard", 0),
        Placement("shard", tp_dim),
    ]
    box = local_box(local_intervals(shape, (dp, tp), layout, coord))
    assert box is not None
    return box


def _row_chunked(shape: Sequence[int], chunk: Sequence[int], offsets: Sequence[int],
                 sizes: Sequence[int]) -> int:  # fmt: skip
    """Data bytes fetched for a box with flat-contiguous chunks (whole rows or row pieces)."""
    (r0, c0), (nr, nc) = offsets, sizes
    if not nr or not nc:
        return 0
    k, m = chunk
    chunk_bytes = k * m * ITEM + CRC_BYTES
    if m == shape[1]:  # chunks of k whole rows: the box reads every row chunk it touches
        return ((r0 + nr - 1) // k - r0 // k + 1) * chunk_bytes
    per_row = (c0 + nc - 1) // m - c0 // m + 1
    return nr * per_row * chunk_bytes


def _tiled(offsets: Sequence[int], sizes: Sequence[int], tile: Sequence[int] = TILE) -> int:
    """Data bytes fetched for a box with box-shaped chunks of ``tile`` (a zarr tile grid)."""
    (r0, c0), (nr, nc) = offsets, sizes
    if not nr or not nc:
        return 0
    tiles = ((r0 + nr - 1) // tile[0] - r0 // tile[0] + 1) * (
        (c0 + nc - 1) // tile[1] - c0 // tile[1] + 1
    )
    return tiles * (tile[0] * tile[1] * ITEM + CRC_BYTES)


def _planner_bytes(shape: Sequence[int], chunking: object, offsets: Sequence[int],
                   sizes: Sequence[int]) -> int:  # fmt: skip
    intervals = tuple(((o, o + s),) for o, s in zip(offsets, sizes, strict=True))
    runs = local_runs(shape, intervals)
    chunk, shard = chunking.chunk_shape, chunking.shard_shape  # type: ignore[attr-defined]
    spans = [chunk_aligned_range(shape, chunk, r.start, r.start + r.length) for r in runs]
    ranges = [(low, high) for low, high, _ in merge_runs(spans)]
    return range_read_cost(shape, chunk, shard, ITEM, ranges).data_bytes


def _box_bytes(shape: Sequence[int], chunking: object, offsets: Sequence[int],
               sizes: Sequence[int]) -> int:  # fmt: skip
    """Data bytes the real planner says one read of the box's runs fetches."""
    intervals = tuple(((o, o + s),) for o, s in zip(offsets, sizes, strict=True))
    runs = [(r.start, r.start + r.length) for r in local_runs(shape, intervals)]
    chunk, shard = chunking.chunk_shape, chunking.shard_shape  # type: ignore[attr-defined]
    return runs_read_cost(shape, chunk, shard, ITEM, runs).data_bytes


def rows(tps: Sequence[int] = (2, 4, 8), dps: Sequence[int] = (1, 8, 64)) -> list[list[str]]:
    """One table row per matrix and dp: amplification at each tp, for the three chunkings."""
    flat_policy, policy = ChunkPolicy(tp_max=1), ChunkPolicy()
    out = []
    for name, shape, tp_dim in MATRICES:
        flat = choose_chunking(shape, ITEM, flat_policy)
        boxed = choose_chunking(shape, ITEM, policy)
        for dp in dps:
            chunks = (
                f"{'x'.join(map(str, flat.chunk_shape))}, {'x'.join(map(str, boxed.chunk_shape))}"
            )
            cells = [name, chunks, str(dp)]
            for tp in tps:
                needed = fetched = tiled = box = 0
                for coord in ((0, 0), (dp - 1, tp - 1), (dp // 2, tp // 2)):
                    offsets, sizes = _box(shape, tp_dim, tp, dp, coord)
                    needed += math.prod(sizes) * ITEM
                    fetched += _row_chunked(shape, flat.chunk_shape, offsets, sizes)
                    tiled += _tiled(offsets, sizes)
                    box += _box_bytes(shape, boxed, offsets, sizes)
                    if math.prod(sizes) * ITEM <= 8 << 20:  # check the model on small boxes
                        want = _planner_bytes(shape, flat, offsets, sizes)
                        got = _row_chunked(shape, flat.chunk_shape, offsets, sizes)
                        assert got == want, (name, dp, tp, coord, got, want)
                cells.append(f"{fetched / needed:.2f} / {tiled / needed:.2f} / {box / needed:.2f}")
            out.append(cells)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table (markdown with ``--markdown``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    parser.parse_args(argv)
    tps = (2, 4, 8)
    print("| matrix | row chunk, box chunk | dp | " + " | ".join(f"tp={t}" for t in tps) + " |")
    print("|---|---|---|" + "---|" * len(tps))
    for cells in rows(tps):
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
