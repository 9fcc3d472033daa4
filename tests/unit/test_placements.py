"""The placement math of ucformat.layout.placements against torch's own splitting.

For every shape, mesh and placements below, torch's placements split ``arange(numel)`` mesh dim
by mesh dim (``Shard._split_tensor``, ``_StridedShard._split_tensor``: the code DTensor uses to
distribute a tensor); the runs ``local_runs`` gives must pick exactly those elements, in that
order, and the first replicas' runs must tile the tensor.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ucformat.layout.placements import (
    Placement,
    local_box,
    local_intervals,
    local_numel,
    local_runs,
    merge_runs,
    run_owners,
)

SHAPES = [(8, 4), (10, 6), (7, 3), (3, 5), (16, 2, 3), (1, 9), (5,), (0, 4), (2, 0)]


def _ours(placement: object) -> Placement:
    if isinstance(placement, _StridedShard):
        return Placement("strided", placement.dim, int(placement.split_factor))
    if isinstance(placement, Shard):
        return Placement("shard", placement.dim)
    return Placement("replicate")


def _torch_local(shape: tuple[int, ...], mesh: tuple[int, ...], placements: list[object],
                 coord: tuple[int, ...]) -> torch.Tensor:  # fmt: skip
    tensor = torch.arange(math.prod(shape)).reshape(shape)
    for size, placement, index in zip(mesh, placements, coord, strict=True):
        if isinstance(placement, (Shard, _StridedShard)):
            pieces, _ = placement._split_tensor(tensor, size, with_padding=False, contiguous=True)
            tensor = pieces[index]
    return tensor


def _layouts(ndim: int) -> list[tuple[tuple[int, ...], list[object]]]:
    out: list[tuple[tuple[int, ...], list[object]]] = []
    one = [Replicate(), *(Shard(d) for d in range(ndim))]
    for size in (1, 2, 3, 4):
        out += [((size,), [p]) for p in one]
    for mesh in ((2, 2), (2, 3), (3, 2)):
        for first, second in itertools.product(one, one):
            out.append((mesh, [first, second]))
        for dim in range(ndim):  # FSDP2 on top of TP (dp outer, tp inner) and the converse
            out.append((mesh, [_StridedShard(dim, split_factor=mesh[1]), Shard(dim)]))
            out.append((mesh, [Shard(dim), _StridedShard(dim, split_factor=2)]))
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_runs_pick_what_torch_places(shape: tuple[int, ...]) -> None:
    for mesh, placements in _layouts(len(shape)):
        ours = [_ours(p) for p in placements]
        flat = torch.arange(math.prod(shape))
        covered: list[tuple[int, int]] = []
        for coord in itertools.product(*(range(s) for s in mesh)):
            want = _torch_local(shape, mesh, placements, coord).reshape(-1)
            intervals = local_intervals(shape, mesh, ours, coord)
            runs = local_runs(shape, intervals)
            got = (
                torch.cat([flat[r.start : r.start + r.length] for r in runs])
                if runs
                else torch.empty(0, dtype=flat.dtype)
            )
            what = f"{shape} {mesh} {placements} {coord}"
            assert torch.equal(got, want), what
            assert local_numel(intervals) == want.numel(), what
            assert [r.chunk_start for r in runs] == [sum(x.length for x in runs[:i])
                                                     for i in range(len(runs))], what  # fmt: skip
            box = local_box(intervals)
            if box is not None and want.numel():
                assert tuple(box[1]) == tuple(_torch_local(shape, mesh, placements, coord).shape), (
                    what
                )
        owners = run_owners(shape, mesh, ours, list(range(math.prod(mesh))))
        covered = [(o.start, o.stop) for o, _ in owners]
        position = 0
        for start, stop in covered:
            assert start == position, f"{shape} {mesh} {placements}: hole or overlap"
            position = stop
        assert position == math.prod(shape)


def test_fsdp2_tp_is_one_box_per_rank() -> None:
    """FSDP2 + TP's (_StridedShard(0, sf=2), Shard(0)) on 2 x 2: each rank one row block,
    rows 0, 8, 4, 12 in rank order (as a stock dcp.save writes its chunks)."""
    placements = [Placement("strided", 0, 2), Placement("shard", 0)]
    starts = []
    for coord in itertools.product(range(2), range(2)):
        box = local_box(local_intervals((16, 4), (2, 2), placements, coord))
        assert box is not None
        starts.append(box[0][0])
    assert starts == [0, 8, 4, 12]


def test_merge_runs_groups_touching_spans() -> None:
    assert merge_runs([(8, 12), (0, 4), (4, 6), (20, 24)]) == [
        (0, 6, [1, 2]), (8, 12, [0]), (20, 24, [3])
    ]  # fmt: skip
    assert merge_runs([]) == []
