"""Who writes which write unit when the units are spread over ranks: pure integer arithmetic.

A :class:`~ucformat.write.plan.WriteUnit` (one shard) is written by exactly one process. Two rules:

* :func:`writers_by_holdings` (live saves): each rank holds some elements of a unit (its flat
  partition covers them); the rank holding the most writes it, so the bytes that cross the
  network are only the few the writer lacks: at a ZeRO-1/2 partition boundary, the smaller side
  of one shard. Ties (a small ZeRO-3 parameter split evenly over the ranks) go to the tied rank
  given the fewest elements so far, so such units spread over every rank by size (a rule by
  the unit's index alone left rank 0 with two of an embedding's three 16 MiB shards).
* :func:`writers_by_balance` (distributed convert): every process can read every source byte,
  so units are cut into ``world_size`` consecutive runs of about equal bytes.

:func:`exchange_rounds` then groups the units that need bytes from other ranks into rounds of
bounded size: one collective exchange per round, so a rank never holds more than about
``budget`` bytes received from others at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["exchange_rounds", "writers_by_balance", "writers_by_holdings"]


def writers_by_holdings(holdings: Sequence[Mapping[int, int]], world_size: int) -> list[int]:
    """The writer of every unit: the rank holding most of its elements.

    Args:
        holdings: per unit, rank -> elements of the unit that rank holds (ranks holding none
            may be omitted). A unit nobody holds (an empty mapping) goes to rank
            ``index % world_size``.
        world_size: number of ranks; every rank in ``holdings`` must be below it.

    Returns:
        One rank per unit. Among the ranks holding the most elements, unit ``i`` goes to the one
        given the fewest elements (over units ``0..i-1``, the sizes of ``holdings``) so far;
        the lowest such rank if several are.

    >>> writers_by_holdings([{0: 10, 1: 3}, {0: 5, 1: 5}, {0: 5, 1: 5}, {}], 2)
    [0, 1, 1, 1]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    writers: list[int] = []
    given = [0] * world_size
    for index, held in enumerate(holdings):
        if any(not 0 <= rank < world_size for rank in held):
            raise ValueError(f"unit {index}: rank outside 0..{world_size - 1} in {dict(held)}")
        best = max(held.values(), default=0)
        tied = [rank for rank, count in held.items() if count == best and count > 0]
        writer = min(tied, key=lambda rank: (given[rank], rank)) if tied else index % world_size
        given[writer] += sum(held.values())
        writers.append(writer)
    return writers


def writers_by_balance(sizes: Sequence[int], world_size: int) -> list[int]:
    """Cut units (in order) into ``world_size`` consecutive runs of about equal total size.

    Unit ``i`` goes to the rank whose equal share of the total contains the unit's midpoint,
    so every rank's total is within one unit's size of ``total / world_size``.

    >>> writers_by_balance([4, 4, 4, 4], 2)
    [0, 0, 1, 1]
    >>> writers_by_balance([10, 1, 1, 1, 1], 2)
    [0, 1, 1, 1, 1]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if any(size < 0 for size in sizes):
        raise ValueError("unit sizes must be >= 0")
    total = sum(sizes)
    count = len(sizes)
    if total == 0:
        return [index * world_size // max(count, 1) for index in range(count)]
    writers: list[int] = []
    before = 0
    for size in sizes:
        middle2 = 2 * before + size  # twice the midpoint: stays in integers
        writers.append(min(world_size - 1, middle2 * world_size // (2 * total)))
        before += size
    return writers


def exchange_rounds(needs: Sequence[int], budget: int) -> list[range]:
    """Group units (in order) into consecutive rounds of at most ``budget`` exchanged bytes.

    Args:
        needs: per unit, the bytes its writer receives from other ranks.
        budget: the most bytes one round moves (a unit needing more gets a round of its own).

    Returns:
        Consecutive, non-empty index ranges covering every unit exactly once.

    >>> exchange_rounds([3, 3, 3, 10, 1], 6)
    [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    rounds: list[range] = []
    start, used = 0, 0
    for index, need in enumerate(needs):
        if index > start and used + need > budget:
            rounds.append(range(start, index))
            start, used = index, 0
        used += need
    if start < len(needs):
        rounds.append(range(start, len(needs)))
    return rounds
