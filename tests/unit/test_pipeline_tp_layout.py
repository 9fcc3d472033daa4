"""The file-set checks of a pipeline x tensor-parallel tag folder (names only: empty files stand
in for DeepSpeed's) and the split each ``universal_checkpoint_info`` pattern list gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ucformat.errors import LayoutMismatchError, SourceNotFoundError, UnsupportedCheckpointError
from ucformat.sources.deepspeed.pipeline_tp import _affine, find_pipeline_tp_files

#: pp2 x tp2 x dp2: mp_rank = stage * 2 + model rank.
PP2TP2DP2 = [
    *(f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in (0, 3) for t in (0, 1)),
    *(f"mp_rank_{m:02d}_model_states.pt" for m in range(4)),
    *(f"zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt" for d in (0, 1) for m in range(4)),
]  # fmt: skip
INFO = {
    "tp_replicated_parameter_patterns": [r"^2\.weight$"],
    "parameter_with_row_parallelism_patterns": [r"^1\.weight$"],
}


def _folder(tmp_path: Path, names: list[str]) -> Path:
    folder = tmp_path / "step3"
    folder.mkdir()
    for name in names:
        (folder / name).touch()
    return folder


def test_files_are_listed_by_stage_model_rank_and_replica(tmp_path: Path) -> None:
    files = find_pipeline_tp_files(_folder(tmp_path, PP2TP2DP2), "step3")
    assert (files.stages, files.degree, files.data_parallel) == (2, 2, 2)
    assert [[p.name for p in stage] for stage in files.model_files] == [
        ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"],
        ["mp_rank_02_model_states.pt", "mp_rank_03_model_states.pt"],
    ]
    assert files.optim_files[1][0][1].name == "zero_pp_rank_1_mp_rank_02_optim_states.pt"


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    names = [n for n in PP2TP2DP2 if n != "zero_pp_rank_1_mp_rank_03_optim_states.pt"]
    with pytest.raises(SourceNotFoundError, match=re.escape("zero_pp_rank_1_mp_rank_03_optim")):
        find_pipeline_tp_files(_folder(tmp_path, names), "step3")


def test_model_files_not_a_multiple_of_the_tp_degree_are_refused(tmp_path: Path) -> None:
    names = [n for n in PP2TP2DP2 if "mp_rank_03" not in n]
    with pytest.raises(LayoutMismatchError, match="3 mp_rank_"):
        find_pipeline_tp_files(_folder(tmp_path, names), "step3")


def test_patterns_give_row_column_and_replicated_splits() -> None:
    row = _affine("1.weight", [(8, 4), (8, 3)], INFO)
    assert row["logical_shape"] == [8, 7]
    assert [r["shard_shape"] for r in row["ranks"].values()] == [[8, 4], [8, 3]]
    assert row["ranks"][1]["pieces"][0]["source"][0] == 4  # column 4 of row 0
    column = _affine("0.bias", [(5,), (5,)], INFO)
    assert column["logical_shape"] == [10]
    assert column["ranks"][1]["pieces"][0]["source"][0] == 5
    whole = _affine("2.weight", [(6,), (6,)], INFO)
    assert whole["logical_shape"] == [6]
    assert all(r["pieces"][0]["shape"] == [6] for r in whole["ranks"].values())


def test_shapes_that_do_not_fit_the_patterns_are_refused() -> None:
    with pytest.raises(LayoutMismatchError, match="replicated"):
        _affine("2.weight", [(6,), (5,)], INFO)
    with pytest.raises(LayoutMismatchError, match="not a split on dim 1"):
        _affine("1.weight", [(8, 4), (7, 4)], INFO)
    both = {**INFO, "tp_replicated_parameter_patterns": [r"^1\."]}
    with pytest.raises(UnsupportedCheckpointError, match="matches both"):
        _affine("1.weight", [(8, 4), (8, 4)], both)
