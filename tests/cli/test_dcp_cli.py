"""``ucformat export dcp`` and ``convert`` of its output: summary, dry run, plan, notes, errors."""

from __future__ import annotations

from math import prod
from pathlib import Path

import pytest
import torch

import ucformat
from tests.cli.helpers import assert_user_error, invoke
from tests.truth import assert_exact
from ucformat.export.dcp import plan_dcp

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"
SOURCE = DATA / "z2-fp32-dsadam-ftb-ws3" / "ckpt"  # FusedAdam: int steps, no torch Adam keys


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dcp-cli") / "ckpt.ucf"
    ucformat.convert(SOURCE, path)
    return path


def test_dry_run_writes_nothing(store: Path, tmp_path: Path) -> None:
    result = invoke("export", "dcp", store, tmp_path / "dcp", "--dry-run", "--world-size", "2")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("would write") and "for 2 rank(s)" in result.stdout
    assert not (tmp_path / "dcp").exists()


@pytest.mark.parametrize("layout", ["flat", "nested"])
def test_round_trip_through_dcp_keeps_every_state(store: Path, tmp_path: Path, layout: str) -> None:
    out = tmp_path / "dcp"
    result = invoke("export", "dcp", store, out, "--world-size", "4", "--layout", layout)
    assert result.exit_code == 0, result.stderr
    assert "note: param groups lacked torch Adam's keys" in result.stderr
    assert "note: integer optimizer steps written as float32 tensors" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp",
    ]  # fmt: skip
    result = invoke("convert", out, tmp_path / "back.ucf")
    assert result.exit_code == 0, result.stderr
    assert "from PyTorch DCP x4 float32" in result.stdout
    before, after = ucformat.open(store), ucformat.open(tmp_path / "back.ucf")
    assert before.manifest.optimizer is not None and after.manifest.optimizer is not None
    for name, entry in before.manifest.params.items():
        for state in entry.states:
            assert_exact(after.read(name, state), before.read(name, state), f"{name}/{state}")
        for state in entry.scalars:
            want = torch.tensor(float(before.read(name, state)))
            assert_exact(after.read(name, state), want, f"{name}/{state}")
    groups = [g.params for g in after.manifest.optimizer.groups]
    assert groups == [g.params for g in before.manifest.optimizer.groups]
    hyper = after.manifest.optimizer.groups[0].hyperparams
    assert hyper["lr"] == before.manifest.optimizer.groups[0].hyperparams["lr"]
    assert hyper["decoupled_weight_decay"] is True  # FusedAdam's AdamW mode
    for name in before.manifest.buffers:
        assert_exact(after.read(name, "buffer"), before.read(name, "buffer"), name)


def test_plan_cuts_fsdp2_shards_into_bounded_pieces(store: Path) -> None:
    manifest = ucformat.open(store).manifest
    plan = plan_dcp(manifest, world_size=3, piece_bytes=64)
    for item in plan.tensors:
        rows = [(p.row_start, p.row_stop) for p in item.pieces]
        covered = [r for a, b in rows for r in range(a, b)]
        assert covered == list(range(item.shape[0] if item.shape else 1)), item.key
        for piece in item.pieces:
            elements = (piece.row_stop - piece.row_start) * item.row_elements
            assert elements * 4 <= max(64, item.row_elements * 4), item.key
            per_rank = -(-item.shape[0] // 3) if item.shape else 1
            assert piece.rank == piece.row_start // per_rank, item.key
    keys = {item.key for item in plan.tensors} | {value.key for value in plan.values}
    assert "model.lm_head.weight" in keys and "model.bn.running_mean" in keys  # alias, buffer
    assert "optimizer.state.emb.weight.exp_avg" in keys
    assert "optimizer.param_groups.emb.weight.lr" in keys
    nested = plan_dcp(manifest, world_size=3, layout="nested")
    nested_keys = {value.key for value in nested.values}
    assert {"optimizer.param_groups.0.lr", "optimizer.param_groups.0.params"} <= nested_keys
    assert plan.nbytes == sum(
        prod(i.shape) * 4 for i in plan.tensors if i.dtype == "float32"
    ) + sum(prod(i.shape) * 8 for i in plan.tensors if i.dtype == "int64")


def test_bad_layout_and_non_empty_destination(store: Path, tmp_path: Path) -> None:
    result = invoke("export", "dcp", store, tmp_path / "x", "--layout", "sideways")
    assert result.exit_code == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    assert_user_error(invoke("export", "dcp", store, tmp_path / "full"), "--overwrite")
