"""Properties of the write-ownership math (ucformat/layout/ownership.py).

Checked on the real partition layouts: shards of a parameter's flat range, held by the ranks
whose ZeRO-1/2 or ZeRO-3 partitions cover them.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ucformat.layout.chunking import ChunkPolicy, choose_chunking
from ucformat.layout.ownership import exchange_rounds, writers_by_balance, writers_by_holdings
from ucformat.layout.partition import PartitionedFlatLayout, PerParamLayout

FAST = settings(max_examples=150, deadline=None)


def _shard_holdings(
    fragments: list[tuple[int, int, int]], numel: int, shard: int
) -> list[dict[int, int]]:
    """Per shard of ``numel`` elements cut every ``shard``: rank -> elements it holds."""
    out: list[dict[int, int]] = []
    for start in range(0, numel, shard):
        stop = min(numel, start + shard)
        held: dict[int, int] = {}
        for rank, lo, hi in fragments:
            overlap = min(hi, stop) - max(lo, start)
            if overlap > 0:
                held[rank] = held.get(rank, 0) + overlap
        out.append(held)
    return out


@FAST
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=6),
    st.integers(1, 8),
    st.integers(1, 64),
    st.booleans(),
)
def test_one_writer_holding_the_most(sizes: list[int], world: int, shard: int, zero3: bool) -> None:
    params = [(f"p{i}", n) for i, n in enumerate(sizes)]
    layout: PartitionedFlatLayout | PerParamLayout = (
        PerParamLayout.build(params, world) if zero3 else PartitionedFlatLayout.build(params, world)
    )
    for name, numel in params:
        frags = [
            (f.rank, f.param_start, f.param_stop) for f in layout.all_fragments() if f.name == name
        ]
        holdings = _shard_holdings(frags, numel, shard)
        writers = writers_by_holdings(holdings, world)
        assert len(writers) == len(holdings)
        covered = 0
        for held, writer in zip(holdings, writers, strict=True):
            assert 0 <= writer < world
            assert held.get(writer, 0) == max(held.values())
            received = sum(held.values()) - held[writer]
            # the writer receives at most what all other holders have together, and never
            # more than (world - 1) / world of the shard
            assert received * world <= sum(held.values()) * (world - 1)
            covered += sum(held.values())
        assert covered == numel  # every element held by exactly one rank


@FAST
@given(st.integers(1, 8), st.integers(1, 40))
def test_ties_spread_over_ranks(world: int, units: int) -> None:
    even = [dict.fromkeys(range(world), 5) for _ in range(units)]
    writers = writers_by_holdings(even, world)
    counts = [writers.count(rank) for rank in range(world)]
    assert max(counts) - min(counts) <= 1


@FAST
@given(st.integers(1, 8), st.lists(st.integers(1, 1000), max_size=60))
def test_tied_units_spread_by_size(world: int, sizes: list[int]) -> None:
    """Evenly split units of any sizes: every rank writes within one unit of the others."""
    even = [dict.fromkeys(range(world), size) for size in sizes]
    writers = writers_by_holdings(even, world)
    given = [
        sum(s * world for s, w in zip(sizes, writers, strict=True) if w == r) for r in range(world)
    ]
    assert max(given) - min(given) <= world * max(sizes, default=0)


def test_ties_do_not_pile_big_units_on_one_rank() -> None:
    """Three big units among small ones, tied at two ranks: the big ones do not all go to one."""
    sizes = [100, 1, 100, 1, 100, 1]
    writers = writers_by_holdings([{0: s, 1: s} for s in sizes], 2)
    assert {writers[0], writers[2], writers[4]} == {0, 1}


@FAST
@given(st.lists(st.integers(0, 1000), max_size=60), st.integers(1, 8))
def test_balance_is_contiguous_and_even(sizes: list[int], world: int) -> None:
    writers = writers_by_balance(sizes, world)
    assert len(writers) == len(sizes)
    assert writers == sorted(writers)
    assert all(0 <= w < world for w in writers)
    total = sum(sizes)
    biggest = max(sizes, default=0)
    for rank in range(world):
        share = sum(s for s, w in zip(sizes, writers, strict=True) if w == rank)
        assert share <= total / world + biggest


@FAST
@given(st.lists(st.integers(0, 100), max_size=60), st.integers(1, 150))
def test_rounds_cover_once_within_budget(needs: list[int], budget: int) -> None:
    rounds = exchange_rounds(needs, budget)
    flat = [i for r in rounds for i in r]
    assert flat == list(range(len(needs)))
    for r in rounds:
        assert len(r) > 0
        assert len(r) == 1 or sum(needs[i] for i in r) <= budget


def test_real_chunking_shards_of_a_boundary_param() -> None:
    """A 1000x1000 fp32 param straddling a ZeRO-1/2 boundary: only the boundary shard moves."""
    layout = PartitionedFlatLayout.build([("a", 10), ("w", 1_000_000)], 2)
    chunking = choose_chunking((1000, 1000), 4, ChunkPolicy(64 * 1024, 1024 * 1024))
    shard = chunking.shard_shape[0] * 1000
    frags = [(f.rank, f.param_start, f.param_stop) for f in layout.all_fragments() if f.name == "w"]
    holdings = _shard_holdings(frags, 1_000_000, shard)
    moving = [h for h in holdings if len(h) > 1]
    assert len(moving) == 1
    writers = writers_by_holdings(holdings, 2)
    assert writers[0] == 0
    assert writers[-1] == 1
