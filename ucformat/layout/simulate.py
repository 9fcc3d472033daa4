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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod

from ucformat.layout.chunking import ChunkPolicy, choose_chunking
from ucformat.layout.partition import PartitionedFlatLayout, PerParamLayout
from ucformat.layout.reads import ReadCost, range_read_cost

__all__ = ["LoadSimulation", "ParamShape", "simulate_load"]

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
