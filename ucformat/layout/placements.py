"""Where a DTensor's local shard sits in the global tensor, for any placements on any mesh.

A DTensor on an N-d device mesh has one placement per mesh dim: ``Replicate()``, ``Shard(d)``
(split tensor dim ``d`` into ``size`` pieces of ``ceil(n / size)``, as ``torch.chunk`` does;
trailing pieces may be short or empty) or ``_StridedShard(d, sf)`` (what FSDP2 on top of
tensor parallelism gives: dim ``d`` was already split into ``sf`` pieces by a mesh dim to the
right; each of those is split into ``size`` pieces and a rank holds its piece of every one).
Mesh dims apply left to right, each to the indices the previous ones left (torch's own rule,
``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``).

So along every tensor dim a rank holds an ordered set of global indices, kept here as
increasing, disjoint intervals (:func:`local_intervals`); the local tensor is the row-major
product of those sets. Plain TP (``Shard(0)``/``Shard(1)``), FSDP2 and FSDP2 + TP give one
interval per dim: a box of the global tensor (:func:`local_box`). For reading and writing
flat row-major arrays, :func:`local_runs` lists the runs of consecutive global flat elements
the local shard covers, in local order (a ``Shard(0)`` shard is one run, a ``Shard(1)``
column block one run per row), and :func:`run_owners` gives every run of the first replica
its owning rank: together they tile the tensor exactly.

Standard library only; checked against torch's own splitting in
``tests/unit/test_placements.py``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ucformat.layout.boxes import Run
from ucformat.layout.dtensor import Owner
from ucformat.layout.partition import ceil_div

__all__ = [
    "Placement",
    "local_box",
    "local_intervals",
    "local_numel",
    "local_runs",
    "merge_runs",
    "primary",
    "run_owners",
]

Interval = tuple[int, int]


@dataclass(frozen=True)
class Placement:
    """One mesh dim's placement: ``kind`` is ``"replicate"``, ``"shard"`` or ``"strided"``.

    ``dim`` is the tensor dim split (shard kinds), ``split_factor`` the strided split (1 for a
    plain ``Shard``).
    """

    kind: str
    dim: int = 0
    split_factor: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("replicate", "shard", "strided"):
            raise ValueError(f"unknown placement kind {self.kind!r}")
        if self.dim < 0 or self.split_factor < 1:
            raise ValueError(f"invalid placement {self}")

    def describe(self) -> str:
        """torch's spelling: ``Replicate()``, ``Shard(1)``, ``_StridedShard(0, sf=2)``."""
        if self.kind == "replicate":
            return "Replicate()"
        if self.kind == "shard":
            return f"Shard({self.dim})"
        return f"_StridedShard({self.dim}, sf={self.split_factor})"


def _piece(size: int, parts: int, index: int) -> Interval:
    """Piece ``index`` of ``parts`` of ``[0, size)`` in ``torch.chunk`` sizes (may be empty)."""
    step = ceil_div(size, parts)
    start = min(index * step, size)
    return start, min(start + step, size)


def _positions(size: int, placement: Placement, parts: int, index: int) -> list[Interval]:
    """The local positions (of ``size``) piece ``index`` of ``parts`` keeps, in order."""
    if placement.kind == "shard":
        return [_piece(size, parts, index)]
    out = []
    for outer in range(placement.split_factor):
        low, high = _piece(size, placement.split_factor, outer)
        sub_low, sub_high = _piece(high - low, parts, index)
        out.append((low + sub_low, low + sub_high))
    return out


def _select(held: list[Interval], positions: list[Interval]) -> list[Interval]:
    """The global intervals at local ``positions`` of the index set ``held`` (merged)."""
    out: list[Interval] = []
    for low, high in positions:
        offset = 0
        for start, stop in held:
            length = stop - start
            a, b = max(low, offset), min(high, offset + length)
            if a < b:
                piece = (start + a - offset, start + b - offset)
                if out and out[-1][1] == piece[0]:
                    out[-1] = (out[-1][0], piece[1])
                else:
                    out.append(piece)
            offset += length
    return out


def _check(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> None:
    if len(placements) != len(mesh_shape):
        raise ValueError(f"{len(placements)} placements for a {len(mesh_shape)}-d mesh")
    for placement in placements:
        if placement.kind != "replicate" and placement.dim >= len(shape):
            raise ValueError(f"{placement.describe()} of a {len(shape)}-d tensor")


def local_intervals(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> tuple[tuple[Interval, ...], ...]:
    """Per tensor dim, the global index intervals held at mesh ``coordinate`` (in order).

    >>> local_intervals((8, 4), (2, 2), [Placement("strided", 0, 2), Placement("shard", 0)],
    ...                 (1, 0))
    (((2, 4),), ((0, 4),))
    >>> local_intervals((8, 4), (2, 2), [Placement("shard", 0), Placement("strided", 0, 2)],
    ...                 (0, 0))
    (((0, 1), (2, 3)), ((0, 4),))
    """
    _check(shape, mesh_shape, placements)
    held: list[list[Interval]] = [[(0, n)] if n else [] for n in shape]
    for size, placement, coord in zip(mesh_shape, placements, coordinate, strict=True):
        if placement.kind == "replicate":
            continue
        current = held[placement.dim]
        count = sum(b - a for a, b in current)
        held[placement.dim] = _select(current, _positions(count, placement, size, coord))
    return tuple(tuple(i for i in h if i[0] < i[1]) for h in held)


def local_numel(intervals: Sequence[tuple[Interval, ...]]) -> int:
    """Elements of a local shard given by :func:`local_intervals`."""
    return math.prod(sum(b - a for a, b in d) for d in intervals)


def local_box(
    intervals: Sequence[tuple[Interval, ...]],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(offsets, sizes)`` when the shard is one box of the global tensor, else None.

    An empty shard is the empty box at the origin.
    """
    lists = [list(d) for d in intervals]
    if any(not d for d in lists):
        return tuple(0 for _ in lists), tuple(0 for _ in lists)
    if any(len(d) != 1 for d in lists):
        return None
    return tuple(d[0][0] for d in lists), tuple(d[0][1] - d[0][0] for d in lists)


def local_runs(shape: Sequence[int], intervals: Sequence[tuple[Interval, ...]]) -> list[Run]:
    """Runs of consecutive global flat elements of the local shard, in local row-major order.

    ``Run.chunk_start`` is the run's offset in the local tensor's flattening. Trailing dims the
    shard holds whole merge into each run.

    >>> local_runs((4, 6), (((0, 4),), ((2, 5),)))[:2]
    [Run(start=2, chunk_start=0, length=3), Run(start=8, chunk_start=3, length=3)]
    """
    lists = [list(d) for d in intervals]
    if not shape:
        return [Run(0, 0, 1)]
    if any(not d for d in lists) or math.prod(shape) == 0:
        return []
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    k = len(shape) - 1  # the last dim not held whole: later dims merge into each run
    while k > 0 and lists[k] == [(0, shape[k])]:
        k -= 1
    leading = [[i for a, b in lists[d] for i in range(a, b)] for d in range(k)]
    runs: list[Run] = []
    position = 0
    for index in itertools.product(*leading):
        base = sum(i * strides[d] for d, i in enumerate(index))
        for low, high in lists[k]:
            length = (high - low) * strides[k]
            runs.append(Run(base + low * strides[k], position, length))
            position += length
    return runs


def _coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return [tuple(c) for c in itertools.product(*(range(s) for s in mesh_shape))]


def primary(placements: Sequence[Placement], coordinate: Sequence[int]) -> bool:
    """Whether ``coordinate`` is the first replica (index 0 on every replicating mesh dim)."""
    return all(c == 0 for c, p in zip(coordinate, placements, strict=True) if p.kind == "replicate")


def run_owners(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_ranks: Sequence[int],
) -> list[tuple[Owner, int]]:
    """Every run of every first-replica local shard with its rank, in flat order.

    Each item is ``(Owner(rank, start, stop), local_start)``: global flat elements
    ``[start, stop)`` are the owner's local flat elements from ``local_start`` on. The owners'
    ranges tile ``[0, numel)`` exactly. ``mesh_ranks`` are the mesh's global ranks, row-major.

    >>> [o for o, _ in run_owners((2, 4), (2,), [Placement("shard", 1)], [0, 1])]
    [Owner(rank=0, start=0, stop=2), Owner(rank=1, start=2, stop=4), \
Owner(rank=0, start=4, stop=6), Owner(rank=1, start=6, stop=8)]
    """
    if len(mesh_ranks) != math.prod(mesh_shape):
        raise ValueError(f"{len(mesh_ranks)} ranks for a mesh of shape {tuple(mesh_shape)}")
    found: list[tuple[Owner, int]] = []
    for rank, coord in zip(mesh_ranks, _coordinates(mesh_shape), strict=True):
        if primary(placements, coord):
            for run in local_runs(shape, local_intervals(shape, mesh_shape, placements, coord)):
                found.append((Owner(rank, run.start, run.start + run.length), run.chunk_start))
    return sorted(found, key=lambda item: item[0].start)


def merge_runs(spans: Sequence[Interval]) -> list[tuple[int, int, list[int]]]:
    """Group runs whose (chunk-widened) ``spans`` overlap or touch into one read each.

    Returns ``(low, high, members)`` per read: ``members`` index ``spans``. Reading a merged
    span once fetches each chunk once, however many runs share it.

    >>> merge_runs([(0, 4), (4, 8), (12, 16)])
    [(0, 8, [0, 1]), (12, 16, [2])]
    """
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    out: list[tuple[int, int, list[int]]] = []
    for i in order:
        low, high = spans[i]
        if out and low <= out[-1][1]:
            last = out[-1]
            out[-1] = (last[0], max(last[1], high), [*last[2], i])
        else:
            out.append((low, high, [i]))
    return out
