"""Pipeline names (layer index + the layer's own name) and the file-set checks of a pipeline
tag folder (names only: empty files stand in for DeepSpeed's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ucformat.errors import SourceNotFoundError, UnsupportedCheckpointError
from ucformat.layout.pipeline import PipelineName, parse_pipeline_name, stage_owners
from ucformat.sources.deepspeed.pipeline import find_pipeline_files, is_pipeline_folder


def test_names_split_into_layer_or_tied_key_and_local_name() -> None:
    assert parse_pipeline_name("12.attn.qkv.weight") == PipelineName(12, None, "attn.qkv.weight")
    assert parse_pipeline_name("tied_modules.embed.weight") == PipelineName(None, "embed", "weight")
    for foreign in ("weight", "a.weight", "tied_modules.embed", "tied_modules..w", "1."):
        assert parse_pipeline_name(foreign) is None


def test_stage_owners_lists_layers_and_tied_keys_per_stage() -> None:
    layers, tied = stage_owners(
        [["tied_modules.e.w", "1.w", "1.b", "0.w"], ["3.w", "tied_modules.e.w", "x.y"]]
    )
    assert layers == [[0, 1], [3]]
    assert tied == [["e"], ["e"]]


def _folder(tmp_path: Path, names: list[str]) -> Path:
    folder = tmp_path / "step3"
    folder.mkdir()
    for name in names:
        (folder / name).touch()
    return folder


PP2DP2 = [
    "layer_00-model_states.pt", "layer_03-model_states.pt",
    "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
    *(f"zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for d in (0, 1) for s in (0, 1)),
]  # fmt: skip


def test_a_complete_file_set_is_listed_by_stage_and_rank(tmp_path: Path) -> None:
    folder = _folder(tmp_path, PP2DP2)
    assert is_pipeline_folder(folder)
    files = find_pipeline_files(folder, "step3")
    assert files.data_parallel == 2
    assert [p.name for p in files.model_files] == PP2DP2[2:4]
    assert files.optim_files[1][0].name == "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    assert sorted(files.layer_files) == [0, 3]


def test_a_missing_rank_file_is_named(tmp_path: Path) -> None:
    folder = _folder(tmp_path, [n for n in PP2DP2 if n != PP2DP2[-1]])
    with pytest.raises(
        SourceNotFoundError, match=re.escape("zero_pp_rank_1_mp_rank_01_optim_states.pt")
    ):
        find_pipeline_files(folder, "step3")


def test_tensor_parallel_layer_files_are_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path, [*PP2DP2, "layer_01-model_00-model_states.pt"])
    with pytest.raises(UnsupportedCheckpointError, match="find_pipeline_tp_files"):
        find_pipeline_files(folder, "step3")


def test_zero0_pipelines_have_no_optimizer_shards(tmp_path: Path) -> None:
    folder = _folder(tmp_path, PP2DP2[:4])  # each stage's optimizer is in its model states
    files = find_pipeline_files(folder, "step3")
    assert files.optim_files == ((), ()) and files.data_parallel == 0
    assert [p.name for p in files.model_files] == PP2DP2[2:4]
