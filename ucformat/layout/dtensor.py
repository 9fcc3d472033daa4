"""DTensor shard arithmetic: which rows of a parameter each rank of a device mesh holds.

FSDP2 (``fully_shard``) makes every parameter a DTensor sharded on dim 0 of a 1-D mesh; HSDP
uses a 2-D mesh ``(replicate, shard)``. A placement per mesh dimension is described here by a
*shard dim*: ``0`` (``Shard(0)``) or ``None`` (``Replicate()``). Along each mesh dimension that
shards dim 0, the rows a rank holds so far are split again into pieces of ``ceil(rows / size)``
rows, as torch splits them; trailing pieces may be short or empty.

A block of whole rows of a row-major tensor is one contiguous flat range, so a rank's local
shard is the flat range :func:`local_flat_range` and reading it is one range read of the store.
Any other placement (``Shard(d)`` for ``d > 0``, ``_StridedShard``: tensor parallelism) is
described by :mod:`ucformat.layout.placements`, which ``ucformat.torch`` uses for every
placement; the functions here stay the FSDP2-only special case.

For writing a store from live shards (``ucformat.torch.save``), :func:`owners` lists which rank
holds each flat range (one replica each), :func:`ucformat.layout.chunking.aligned_chunking`
picks chunk and shard shapes whose boundaries fall on the owners' boundaries when that keeps
chunks reasonably large (who writes each shard is :mod:`ucformat.layout.ownership`'s rule).
Everything here is integer arithmetic on plain data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ucformat.layout.partition import ceil_div

__all__ = [
    "Owner",
    "local_flat_range",
    "local_rows",
    "owners",
    "primary_replica",
    "split_rows",
]

#: One placement per mesh dimension: ``0`` shards tensor dim 0, ``None`` replicates.
ShardDims = Sequence[int | None]


def split_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of piece ``index`` when ``rows`` are split into ``parts`` pieces
    of ``ceil(rows / parts)`` (torch's ``Shard`` split; the last pieces may be short or empty).

    >>> [split_rows(10, 4, i) for i in range(4)]
    [(0, 3), (3, 6), (6, 9), (9, 10)]
    >>> split_rows(2, 3, 2)
    (2, 2)
    """
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"piece {index} of {parts} does not exist")
    size = ceil_div(rows, parts)
    start = min(index * size, rows)
    return start, min(start + size, rows)


def _check_dims(shard_dims: ShardDims, mesh_shape: Sequence[int]) -> None:
    if len(shard_dims) != len(mesh_shape):
        raise ValueError(f"{len(shard_dims)} placements for a {len(mesh_shape)}-d mesh")
    bad = [dim for dim in shard_dims if dim not in (0, None)]
    if bad:
        raise ValueError(
            f"only Shard(0) and Replicate() placements are supported, got Shard({bad[0]})"
        )


def local_rows(
    dim0: int, mesh_shape: Sequence[int], shard_dims: ShardDims, coordinate: Sequence[int]
) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 held at mesh ``coordinate``.

    >>> local_rows(64, (3,), (0,), (2,))
    (44, 64)
    >>> local_rows(10, (2, 2), (None, 0), (1, 1))
    (5, 10)
    """
    _check_dims(shard_dims, mesh_shape)
    start, stop = 0, dim0
    for size, dim, coord in zip(mesh_shape, shard_dims, coordinate, strict=True):
        if dim == 0:
            low, high = split_rows(stop - start, size, coord)
            start, stop = start + low, start + high
    return start, stop


def local_flat_range(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    shard_dims: ShardDims,
    coordinate: Sequence[int],
) -> tuple[int, int]:
    """The flat element range ``[start, stop)`` of a tensor of ``shape`` held at ``coordinate``.

    >>> local_flat_range((64, 20), (3,), (0,), (1,))
    (440, 880)
    """
    if not shape:
        _check_dims(shard_dims, mesh_shape)
        if any(dim == 0 for dim in shard_dims):
            raise ValueError("a 0-d tensor cannot be sharded")
        return 0, 1
    inner = math.prod(shape[1:])
    start, stop = local_rows(shape[0], mesh_shape, shard_dims, coordinate)
    return start * inner, stop * inner


def primary_replica(shard_dims: ShardDims, coordinate: Sequence[int]) -> bool:
    """Whether ``coordinate`` is the first replica (index 0 on every replicating mesh dim)."""
    return all(c == 0 for c, dim in zip(coordinate, shard_dims, strict=True) if dim is None)


@dataclass(frozen=True)
class Owner:
    """Global ``rank`` holds flat elements ``[start, stop)`` (its first-replica local shard)."""

    rank: int
    start: int
    stop: int


def _coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    coords: list[tuple[int, ...]] = [()]
    for size in mesh_shape:
        coords = [(*c, i) for c in coords for i in range(size)]
    return coords


def owners(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    shard_dims: ShardDims,
    mesh_ranks: Sequence[int],
) -> list[Owner]:
    """One owner per non-empty local shard of the first replica, in flat order.

    ``mesh_ranks`` are the global ranks of the mesh, row-major over ``mesh_shape``. The owners'
    ranges tile ``[0, numel)`` exactly.

    >>> owners((5, 2), (2, 2), (None, 0), [0, 1, 2, 3])
    [Owner(rank=0, start=0, stop=6), Owner(rank=1, start=6, stop=10)]
    """
    if len(mesh_ranks) != math.prod(mesh_shape):
        raise ValueError(f"{len(mesh_ranks)} ranks for a mesh of shape {tuple(mesh_shape)}")
    found = []
    for rank, coord in zip(mesh_ranks, _coordinates(mesh_shape), strict=True):
        if primary_replica(shard_dims, coord):
            start, stop = local_flat_range(shape, mesh_shape, shard_dims, coord)
            if start < stop:
                found.append(Owner(rank, start, stop))
    return sorted(found, key=lambda owner: owner.start)
