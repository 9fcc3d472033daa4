"""``verify --against`` over the whole DeepSpeed grid: no false alarm on any real layout.

Stage 1/2/3, every dtype and optimizer wrapper, parameter alignment, round-robin gradients,
legacy elastic shards, ZeRO-3 sub-groups, frozen and tied parameters (tests/fixtures/ds_cases.py),
converted with tiny chunks and shards so that shards cut across every ZeRO partition boundary.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ucformat
from tests.fixtures.ds_cases import ALL

pytestmark = pytest.mark.deepspeed


@pytest.mark.parametrize("case", [c.name for c in ALL])
def test_grid_case_verifies_against_its_source(case: str, ds_grid: Path, tmp_path: Path) -> None:
    source = ds_grid / case / "ckpt"
    ucformat.convert(source, tmp_path / "store", chunk_bytes=48, shard_bytes=192)
    report = ucformat.verify(tmp_path / "store", against=source)
    assert report.ok, [str(p) for p in report.problems]
    assert report.source_bytes == report.nbytes > 0
