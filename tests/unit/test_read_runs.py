"""UniversalCheckpoint.read_runs: a DTensor-like box of a stored array, read as runs of flat
elements (one per row for a column block), each chunk fetched once, bytes as the planner says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ucformat
import ucformat.torch as uctorch
from ucformat.errors import UnsupportedExportError
from ucformat.format.dtypes import itemsize
from ucformat.layout.chunking import chunk_aligned_range
from ucformat.layout.placements import Placement, local_intervals, local_runs, merge_runs
from ucformat.layout.reads import range_read_cost
from ucformat.torch.dtensor import placement_of


@pytest.fixture(scope="module", params=[640, 80], ids=["4-row-chunks", "half-row-chunks"])
def store(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[Path, torch.Tensor]:
    """Weight [30, 40] fp32 in chunks of 4 whole rows (a column block's runs merge into one
    read) or of 20 elements (half a row: the runs of a column block stay apart)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(40, 30, bias=False)
    path = tmp_path_factory.mktemp("runs") / "w.ucf"
    uctorch.save(model, None, path, chunk_bytes=request.param, shard_bytes=2560)
    return path, model.weight.detach().clone()


@pytest.mark.parametrize(
    ("placements", "mesh"),
    [
        ([Placement("shard", 1)], (3,)),
        ([Placement("shard", 0)], (4,)),
        ([Placement("strided", 0, 2), Placement("shard", 0)], (2, 2)),
        ([Placement("shard", 0), Placement("shard", 1)], (2, 3)),
    ],
    ids=["shard1", "shard0", "strided", "2d"],
)
def test_read_runs_reads_the_box(
    store: tuple[Path, torch.Tensor], placements: list[Placement], mesh: tuple[int, ...]
) -> None:
    path, weight = store
    for coord in [(i,) for i in range(mesh[0])] if len(mesh) == 1 else [(0, 0), (1, 2 % mesh[1])]:
        ckpt = ucformat.open(path)
        ref = ckpt.array_ref("weight", "value")
        intervals = local_intervals((30, 40), mesh, placements, coord)
        runs = local_runs((30, 40), intervals)
        rows = [i for a, b in intervals[0] for i in range(a, b)]
        cols = [j for a, b in intervals[1] for j in range(a, b)]
        before = ckpt.stats.bytes_read
        got = ckpt.read_runs("weight", "value", runs)
        assert torch.equal(got.reshape(len(rows), len(cols)), weight[rows][:, cols])
        spans = [chunk_aligned_range(ref.shape, ref.chunk_shape, r.start, r.start + r.length)
                 for r in runs]  # fmt: skip
        cost = range_read_cost(ref.shape, ref.chunk_shape, ref.shard_shape, itemsize(ref.dtype),
                               [(lo, hi) for lo, hi, _ in merge_runs(spans)])  # fmt: skip
        assert ckpt.stats.bytes_read - before == cost.total


def test_partial_is_refused_in_one_line() -> None:
    from torch.distributed.tensor import Partial

    with pytest.raises(UnsupportedExportError) as err:
        placement_of("w", Partial())
    assert "\n" not in str(err.value) and "'w'" in str(err.value)
