"""Convert the committed DeepSpeed fixtures (no DeepSpeed needed) and compare with the truth."""

from __future__ import annotations

from pathlib import Path

import pytest

import ucformat
from tests.truth import assert_store_matches_truth, load_truth

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"
CASES = sorted(p.name for p in DATA.iterdir() if (p / "truth.pt").exists())


@pytest.mark.parametrize("case", CASES)
def test_committed_fixture_converts_exactly(case: str, tmp_path: Path) -> None:
    manifest = ucformat.convert(DATA / case / "ckpt", tmp_path / "out.ucf")
    ckpt = ucformat.open(tmp_path / "out.ucf")
    assert ckpt.manifest == manifest
    assert_store_matches_truth(ckpt, load_truth(DATA / case))
