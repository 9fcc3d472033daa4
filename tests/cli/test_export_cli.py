"""``ucformat export ...``: summaries, dry runs, overwrite rules and one-line errors (exit 2)."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest

import ucformat
from tests.cli.helpers import assert_user_error, invoke

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"
SOURCE = DATA / "z2-fp32-dsadam-ftb-ws3" / "ckpt"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "ckpt.ucf"
    ucformat.convert(SOURCE, path)
    return path


def test_export_help_lists_the_three_targets() -> None:
    result = invoke("export", "--help")
    assert result.exit_code == 0
    for command in ("safetensors", "deepspeed-universal", "deepspeed"):
        assert command in result.stdout


def test_safetensors(store: Path, tmp_path: Path) -> None:
    result = invoke("export", "safetensors", store, tmp_path / "hf", "--dtype", "bf16",
                    "--max-shard-size", "300B")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("wrote 10 tensors") and "bfloat16 params" in result.stdout
    assert "note: tied aliases not stored" in result.stderr
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "emb.weight" in index["weight_map"] and "lm_head.weight" not in index["weight_map"]


def test_dry_runs_write_nothing(store: Path, tmp_path: Path) -> None:
    for args in (
        ("safetensors",),
        ("deepspeed-universal",),
        ("deepspeed", "--world-size", 5, "--stage", 3),
    ):
        result = invoke("export", *args, store, tmp_path / "out", "--dry-run")
        assert result.exit_code == 0, result.stderr
        assert result.stdout.startswith("would write"), result.stdout
        assert not (tmp_path / "out").exists()
    result = invoke("export", "deepspeed", store, tmp_path / "o", "--world-size", 5, "--stage",
                    3, "--dry-run")  # fmt: skip
    assert "ZeRO-3 x5 float32" in result.stdout and "DeepSpeedZeroOptimizer_Stage3" in result.stdout


def test_deepspeed_and_universal(store: Path, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    result = invoke("export", "deepspeed", store, tmp_path / "run", "--world-size", 2,
                    "--stage", 1, "--dtype", "bf16", "--tag", "resume", "-q")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("wrote DeepSpeed ZeRO-1 x2 bfloat16 checkpoint")
    assert (tmp_path / "run" / "latest").read_text() == "resume"
    assert sorted(p.name for p in (tmp_path / "run" / "resume").iterdir()) == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "mp_rank_00_model_states.pt",
    ]
    result = invoke("export", "deepspeed-universal", store, tmp_path / "uc")
    assert result.exit_code == 0, result.stderr
    assert "frozen parameters (2) or buffers (3)" in result.stderr
    assert (tmp_path / "uc" / "latest_universal").read_text() == "global_step4_universal"


def test_overwrite_replaces_only_what_the_export_writes(store: Path, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    assert invoke("export", "deepspeed", store, out, "--world-size", 2, "--stage", 2).exit_code == 0
    (out / "notes.txt").write_text("keep me")
    (out / "global_step4" / "stale.pt").write_text("from an earlier export")
    result = invoke("export", "deepspeed", store, out, "--world-size", 3, "--stage", 2,
                    "--overwrite")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert (out / "notes.txt").read_text() == "keep me"
    assert not (out / "global_step4" / "stale.pt").exists()
    assert len(list((out / "global_step4").glob("zero_pp_rank_*_optim_states.pt"))) == 3
    assert sorted(p.name for p in out.iterdir()) == ["global_step4", "latest", "notes.txt"]


def test_run_folder_gets_a_new_tag_beside_the_old(store: Path, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    assert invoke("export", "deepspeed", store, out, "--world-size", 2, "--stage", 2).exit_code == 0
    old = {p.name: p.read_bytes() for p in (out / "global_step4").iterdir()}
    result = invoke("export", "deepspeed", store, out, "--world-size", 3, "--stage", 3, "-q")
    assert result.exit_code == 0, result.stderr
    assert "tag global_step4_ws3_zero3" in result.stdout
    assert "note: latest: global_step4 -> global_step4_ws3_zero3; global_step4 is kept" in (
        result.stderr
    )
    assert (out / "latest").read_text() == "global_step4_ws3_zero3"
    assert {p.name: p.read_bytes() for p in (out / "global_step4").iterdir()} == old
    assert len(list((out / "global_step4_ws3_zero3").glob("zero_pp_rank_*_model_states.pt"))) == 3
    again = invoke("export", "deepspeed", store, out, "--world-size", 3, "--stage", 3)
    assert_user_error(again, "global_step4_ws3_zero3: already exists; pass --tag NAME")
    named = invoke("export", "deepspeed", store, out, "--world-size", 1, "--stage", 1,
                   "--tag", "one", "--remove-previous")  # fmt: skip
    assert named.exit_code == 0, named.stderr
    assert "global_step4_ws3_zero3 removed" in named.stderr
    assert sorted(p.name for p in out.iterdir()) == ["global_step4", "latest", "one"]
    assert (out / "latest").read_text() == "one"
    bad = invoke("export", "deepspeed", store, out, "--world-size", 1, "--stage", 1,
                 "--tag", "../elsewhere")  # fmt: skip
    assert_user_error(bad, "is not a folder name")


def test_non_empty_folder_without_latest_is_refused(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "stuff"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = invoke("export", "deepspeed", store, out, "--world-size", 2, "--stage", 2)
    assert_user_error(result, "has no 'latest' file (not a DeepSpeed checkpoint folder)")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("deepspeed", "--world-size", 2, "--stage", 4),
         ("ZeRO stage 4 is not a native export target; expected 1, 2 or 3.",)),
        (("safetensors", "--dtype", "int8"), ("dtype 'int8' is not an export dtype",)),
        (("safetensors", "--max-shard-size", "lots"), ("size 'lots' is not understood",)),
        (("deepspeed", "--world-size", 2, "--stage", 2, "--dtype", "fp8"), ("'fp8'",)),
    ],
)  # fmt: skip
def test_bad_options(store: Path, tmp_path: Path, args: tuple[Any, ...], fragments: Any) -> None:
    command, *options = args
    assert_user_error(invoke("export", command, store, tmp_path / "out", *options), *fragments)
    assert not (tmp_path / "out").exists()


def test_bad_inputs(store: Path, tmp_path: Path) -> None:
    missing = invoke("export", "safetensors", tmp_path / "nope.ucf", tmp_path / "out")
    assert missing.exit_code == 2 and missing.stderr.startswith("error: ")
    config = tmp_path / "ds.json"
    config.write_text("{not json")
    bad = invoke("export", "deepspeed", store, tmp_path / "out", "--world-size", 2, "--stage", 2,
                 "--config", config)  # fmt: skip
    assert_user_error(bad, "is not a JSON DeepSpeed config")
    config.write_text(json.dumps({"zero_optimization": {"round_robin_gradients": True}}))
    refused = invoke("export", "deepspeed", store, tmp_path / "out", "--world-size", 2,
                     "--stage", 2, "--config", config)  # fmt: skip
    assert_user_error(refused, "round_robin_gradients")
    (tmp_path / "file").write_text("x")
    assert_user_error(invoke("export", "safetensors", store, tmp_path / "file"), "is a file")


def test_missing_deepspeed_is_one_line(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def no_deepspeed(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] == "deepspeed":
            raise ImportError("No module named 'deepspeed'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_deepspeed)
    result = invoke("export", "deepspeed", store, tmp_path / "o", "--world-size", 2, "--stage", 3)
    assert_user_error(result, "needs DeepSpeed importable at export time",
                      "pip install 'ucformat[deepspeed]'")  # fmt: skip
    assert not (tmp_path / "o").exists()
    universal = invoke("export", "deepspeed-universal", store, tmp_path / "u")
    assert_user_error(universal, "'export deepspeed-universal' needs DeepSpeed")


def test_store_without_optimizer_state_is_refused(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened = ucformat.open(store)
    bare = opened.manifest.model_copy(update={"optimizer": None})
    monkeypatch.setattr(opened, "manifest", bare)
    monkeypatch.setattr("ucformat.export.common.open_checkpoint", lambda _: opened)
    result = invoke("export", "deepspeed", store, tmp_path / "o", "--world-size", 2, "--stage", 1)
    assert_user_error(result, "writes optimizer state, but this store has none")
    result = invoke("export", "deepspeed-universal", store, tmp_path / "o")
    assert_user_error(result, "'export deepspeed-universal' writes optimizer state")
    assert invoke("export", "safetensors", store, tmp_path / "o").exit_code == 0
