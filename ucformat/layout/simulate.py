"""Simulated loads: the bytes a W-rank job would fetch from a store, computed without data.

For a model given as ``(name, shape)`` parameters, :func:`simulate_load` lays the parameters
out as a DeepSpeed engine at world size ``W`` would (ZeRO-1/2: each param group flattened and
partitioned, :class:`~ucformat.layout.partition.PartitionedFlatLayout`; ZeRO-3: every parameter
split into ``ceil(n / W)`` pieces, :class:`~ucformat.layout.partition.PerParamLayout`), chunks
every array with :func:`~ucformat.layout.chunking.choose_chunking`, and sums over all ranks the
bytes the loader's reads cost (:func:`~ucformat.layout.reads.range_read_cost`: whole chunks with
their checksums, plus one shard index per shard a rank touches). Each rank reads, for every
fragment it owns, exactly that flat range of the parameter's array, as
:mod:`ucformat.read.partitions` does.

The result is the read amplification of one state (``fp32``; every optimizer state has the same
layout and so the same ratio): fetched bytes over needed bytes, summed over ranks. Pure
arithmetic, used for the scale table in docs/benchmarks.md.

:func:`simulate_read_once` runs the read-once planning (:mod:`ucformat.layout.read_once`) of a
whole job without data: every rank's needs (from the caller's planners), every home's plan,
and the bytes and requests each rank then reads and the bytes it moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from math import prod

from ucformat.layout.cells import CellGrid, Rect
from ucformat.layout.chunking import ChunkPolicy, choose_chunking
from ucformat.layout.partition import PartitionedFlatLayout, PerParamLayout
from ucformat.layout.read_once import (
    SEND,
    BlockPolicy,
    NeedItems,
    Row,
    ShardNeeds,
    plan_shards,
    rank_demands,
    reads_cost,
)
from ucformat.layout.reads import ReadCost, chunk_rects_read_cost, range_read_cost

__all__ = [
    "LoadSimulation",
    "ParamShape",
    "RankNeeds",
    "RankTraffic",
    "ReadOnceSimulation",
    "own_cost",
    "simulate_load",
    "simulate_read_once",
]

ParamShape = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class LoadSimulation:
    """Bytes all ranks of a simulated load fetch and need, for one state."""

    world_size: int
    stage: int
    needed: int
    data: int
    index: int

    @property
    def fetched(self) -> int:
        """All bytes fetched: chunks (with checksums) and shard indexes."""
        return self.data + self.index

    @property
    def amplification(self) -> float:
        """Fetched over needed bytes."""
        return self.fetched / self.needed if self.needed else 0.0


def simulate_load(
    params: Sequence[ParamShape],
    world_size: int,
    stage: int,
    policy: ChunkPolicy,
    *,
    itemsize: int = 4,
    groups: Sequence[Sequence[str]] | None = None,
) -> LoadSimulation:
    """Simulate every rank of a ``world_size`` ZeRO-``stage`` load of one state.

    Args:
        params: every parameter, ``(name, shape)``, in the model's order.
        world_size: the loading job's data-parallel world size.
        stage: 1 or 2 (flat partitions per param group) or 3 (per-parameter pieces).
        policy: the chunk policy the store was written with.
        itemsize: bytes per element of the state (4 for fp32 and Adam states).
        groups: optimizer param groups as lists of names in flattening order (ZeRO-1/2);
            default one group of every parameter. ZeRO-3 ignores groups (each parameter is
            partitioned on its own).

    >>> sim = simulate_load([("w", (4, 8))], 2, 3, ChunkPolicy(chunk_bytes=32, shard_bytes=64))
    >>> sim.needed, sim.data, sim.index, sim.amplification
    (128, 144, 72, 1.6875)
    """
    shapes = dict(params)
    chunkings = {name: choose_chunking(shape, itemsize, policy) for name, shape in params}
    numels = {name: prod(shape) for name, shape in params}
    cost_cache: dict[tuple[tuple[int, ...], int, int], ReadCost] = {}

    def cost(name: str, start: int, stop: int) -> ReadCost:
        key = (shapes[name], start, stop)
        found = cost_cache.get(key)
        if found is None:
            chunking = chunkings[name]
            found = cost_cache[key] = range_read_cost(
                shapes[name], chunking.chunk_shape, chunking.shard_shape, itemsize, [(start, stop)]
            )
        return found

    data = index = 0
    for name, start, stop, count in _rank_ranges(params, numels, world_size, stage, groups):
        spent = cost(name, start, stop)
        data += count * spent.data_bytes
        index += count * spent.index_bytes
    needed = itemsize * sum(numels.values())
    return LoadSimulation(world_size, stage, needed, data, index)


def _rank_ranges(
    params: Sequence[ParamShape],
    numels: dict[str, int],
    world_size: int,
    stage: int,
    groups: Sequence[Sequence[str]] | None,
) -> Iterator[tuple[str, int, int, int]]:
    """Every flat range ranks read, one per owned fragment: ``(name, start, stop, count)``.

    ``count`` ranges of that cost: under ZeRO-3 a parameter's pieces depend only on its shape,
    so parameters of one shape (every layer's) are simulated once.
    """
    if stage == 3:
        first_of: dict[tuple[int, ...], str] = {}
        count: dict[str, int] = {}
        for name, shape in params:
            owner = first_of.setdefault(shape, name)
            count[owner] = count.get(owner, 0) + 1
        layout = PerParamLayout.build([(name, numels[name]) for name in count], world_size)
        for fragment in layout.all_fragments():
            yield fragment.name, fragment.param_start, fragment.param_stop, count[fragment.name]
        return
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage}")
    for group in groups if groups is not None else [[name for name, _ in params]]:
        flat = PartitionedFlatLayout.build([(name, numels[name]) for name in group], world_size)
        for fragment in flat.all_fragments():
            yield fragment.name, fragment.param_start, fragment.param_stop, 1


# --- read once, job-wide (ucformat.layout.read_once) -----------------------------------------
@dataclass
class RankTraffic:
    """What one rank of a simulated read-once load does."""

    bytes_read: int = 0
    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    #: What the rank's own reads of its needs would fetch (bytes, requests).
    own_bytes: int = 0
    own_requests: int = 0
    #: Demands it sends to homes, and demands it receives as a home.
    demands: int = 0
    homed: int = 0
    #: Ranks it sends to, and ranks it receives from.
    fan_out: int = 0
    fan_in: int = 0


@dataclass
class ReadOnceSimulation:
    """A simulated read-once load: job-wide bytes and each rank's traffic."""

    world_size: int
    ranks: list[RankTraffic]
    #: Bytes of the cells some rank needs, each once; and summed over the ranks needing them.
    union_bytes: int = 0
    demanded_bytes: int = 0
    blocks: int = 0
    #: For the sampled ranks: what they receive as homes (grouped as a home groups it), and
    #: the rows they get back from every home.
    homed: dict[int, ShardNeeds] = field(default_factory=dict)
    rows: dict[int, list[Row]] = field(default_factory=dict)

    @property
    def storage_bytes(self) -> int:
        """Bytes all readers fetch from storage (chunks with checksums, shard indexes)."""
        return sum(rank.bytes_read for rank in self.ranks)

    @property
    def storage_requests(self) -> int:
        """Requests all readers make."""
        return sum(rank.requests for rank in self.ranks)

    @property
    def own_bytes(self) -> int:
        """Bytes the ranks' own reads would fetch."""
        return sum(rank.own_bytes for rank in self.ranks)

    @property
    def own_requests(self) -> int:
        """Requests the ranks' own reads would make."""
        return sum(rank.own_requests for rank in self.ranks)

    @property
    def exchanged_bytes(self) -> int:
        """Bytes moved between ranks."""
        return sum(rank.bytes_sent for rank in self.ranks)


#: A rank's needs: per stored array id, flat ranges and boxes
#: (:data:`~ucformat.layout.read_once.NeedItems`).
RankNeeds = Mapping[int, NeedItems]


def simulate_read_once(
    grids: Mapping[int, CellGrid],
    world_size: int,
    needs_of: Callable[[int], RankNeeds],
    policy: BlockPolicy | None = None,
    *,
    sample: Callable[[ReadOnceSimulation], Iterable[int]] | None = None,
) -> ReadOnceSimulation:
    """Run the read-once planning of a ``world_size`` job with no data: every rank's demands
    (:func:`~ucformat.layout.read_once.rank_demands` of ``needs_of(rank)``), every home's plan
    (:func:`~ucformat.layout.read_once.plan_shards`, the code a home runs), and what each rank
    then reads (:func:`~ucformat.layout.read_once.reads_cost`) and moves.

    Own reads are costed from the same demands (:func:`own_cost`). ``sample``,
    called once every demand is known, names ranks whose inputs as a home and whose rows are
    kept (to plan them again alone).
    """
    sim = ReadOnceSimulation(world_size, [RankTraffic() for _ in range(world_size)])
    # per home, per shard: the ranks by the rects they need of it, as the home groups them (a
    # rank's rects for one shard are one key: replicas share it, so memory grows with the
    # distinct needs, not with the ranks)
    per_home: list[dict[tuple[int, int], dict[tuple[Rect, ...], list[int]]]] = [
        {} for _ in range(world_size)
    ]
    for rank in range(world_size):
        traffic = sim.ranks[rank]
        mine: dict[tuple[int, int], tuple[int, list[Rect]]] = {}
        for home, demand in rank_demands(rank, needs_of(rank), grids, world_size):
            grid = grids[demand.array]
            shard = grid.shard_of(demand.rect[0])[0]
            mine.setdefault((demand.array, shard), (home, []))[1].append(demand.rect)
            traffic.demands += 1
            sim.ranks[home].homed += 1
        by_array: dict[int, list[Rect]] = {}
        for key, (home, rects) in mine.items():
            per_home[home].setdefault(key, {}).setdefault(tuple(sorted(rects)), []).append(rank)
            by_array.setdefault(key[0], []).extend(rects)
        own = own_cost(by_array, grids)
        traffic.own_bytes, traffic.own_requests = own.total, own.requests
    kept = set(sample(sim)) if sample is not None else set()
    peers_out: list[set[int]] = [set() for _ in range(world_size)]
    peers_in: list[set[int]] = [set() for _ in range(world_size)]
    for home in range(world_size):
        shards = per_home[home]
        per_home[home] = {}
        if home in kept:
            sim.homed[home] = shards
        plan = plan_shards(shards, grids, policy, home=home)
        sim.union_bytes += plan.union_bytes
        sim.demanded_bytes += plan.demanded_bytes
        sim.blocks += plan.blocks - (home << 32)
        for rank, rows in plan.rows.items():
            if rank in kept:
                sim.rows.setdefault(rank, []).extend(rows)
            cost = reads_cost(rows, grids)
            traffic = sim.ranks[rank]
            traffic.bytes_read += cost.total
            traffic.requests += cost.requests
            for row in rows:
                if row.kind == SEND and row.peer != rank:
                    nbytes = grids[row.array].nbytes(row.rect)
                    traffic.bytes_sent += nbytes
                    sim.ranks[row.peer].bytes_received += nbytes
                    peers_out[rank].add(row.peer)
                    peers_in[row.peer].add(rank)
    for rank, traffic in enumerate(sim.ranks):
        traffic.fan_out, traffic.fan_in = len(peers_out[rank]), len(peers_in[rank])
    return sim


def own_cost(rects: Mapping[int, Sequence[Rect]], grids: Mapping[int, CellGrid]) -> ReadCost:
    """What a rank's own reads of its cells ``rects`` (per stored array) fetch: every chunk
    once, every shard index once; the requests of one read of each array's cells (its box
    chunks' runs stored back to back, its flat ranges per shard). A loader reads each logical
    array of a stack apart, so its requests can be a few more where a rank needs neighbouring
    arrays of one stack; bytes are the same."""
    total = ReadCost(0, 0, 0, 0)
    for array, cells in rects.items():
        grid = grids[array]
        layout = (grid.shape, grid.chunk_shape, grid.shard_shape, grid.itemsize)
        if grid.box:
            parts = [part for rect in cells for part in grid.chunk_rects(rect)]
            total += chunk_rects_read_cost(*layout, [parts])
        else:
            runs = [run[:2] for rect in sorted(cells) for run in grid.region_runs(rect, 0)]
            total += range_read_cost(*layout, runs)
    return total
