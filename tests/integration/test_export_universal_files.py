"""``export deepspeed-universal`` writes what DeepSpeed's own ``ds_to_universal`` writes.

The committed fixtures are converted twice: by DeepSpeed (``ds_to_universal``, serial, with
``--inject_missing_state`` because the fixtures were saved without
``universal_checkpoint_info``) and by ucformat (convert, then export). Every per-parameter file
must hold the same tensor bit for bit, ``step.pt`` the same value and type, and
``optimizer_state.pt`` the same loss scaler, clip, stage, partition counts and param groups.

Differences by design (docs/exports.md): ucformat writes one folder for every target stage (both
model-states names, the ZeRO-1/2 *and* ZeRO-3 keys of ``optimizer_state.pt``, ``{'param': ...}``
files with the parameter's shape and a ``step.pt`` also for ZeRO-3 sources), and no fallback
``fp32.pt`` for frozen parameters, buffers or tied aliases, which DeepSpeed's loader never reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ucformat
from tests.integration.test_export_deepspeed_files import compare
from ucformat.export import export_deepspeed_universal

pytestmark = pytest.mark.deepspeed

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def load(path: Path) -> Any:
    return torch.load(path, weights_only=False, map_location="cpu")


def ds_to_universal(source: Path, out: Path) -> None:
    command = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", str(source), "--output_folder", str(out),
        "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1",
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    subprocess.run(command, check=True, capture_output=True, env=env)


@pytest.mark.parametrize("case", ["z1-bf16-dsadam-simple-ws2", "z3-bf16-dsadam-ftb-ws4"])
def test_universal_files_equal_ds_to_universal(case: str, tmp_path: Path) -> None:
    source = DATA / case / "ckpt" / "global_step4"
    ds_to_universal(source, tmp_path / "ds" / "global_step4_universal")
    ucformat.convert(source, tmp_path / "s.ucf")
    result = export_deepspeed_universal(tmp_path / "s.ucf", tmp_path / "uc")
    theirs, ours = tmp_path / "ds" / "global_step4_universal", tmp_path / "uc"
    assert (ours / "latest_universal").read_text() == "global_step4_universal"
    assert (tmp_path / "ds" / "latest_universal").read_text() == "global_step4_universal"
    ours = ours / "global_step4_universal"
    manifest = ucformat.open(tmp_path / "s.ucf").manifest
    assert manifest.optimizer is not None
    trainable = [n for g in manifest.optimizer.groups for n in g.params]
    zero3 = manifest.source.zero_stage == 3
    problems: list[str] = []
    for name in trainable:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            mine = load(ours / "zero" / name / f"{state}.pt")
            assert mine["cat_dim"] == 0 and list(mine["param"].shape) == manifest.params[name].shape
            want = load(theirs / "zero" / name / f"{state}.pt")
            want = want if zero3 else want["param"]
            compare(mine["param"].reshape(want.shape), want, f"{name}/{state}", problems)
        if not zero3:
            compare(load(ours / f"zero/{name}/step.pt"), load(theirs / f"zero/{name}/step.pt"),
                    f"{name}/step", problems)  # fmt: skip
    mine_opt = load(ours / "zero" / "optimizer_state.pt")
    want_opt = load(theirs / "zero" / "optimizer_state.pt")
    if zero3:
        inner = want_opt["optimizer_state_dict"]
        compare(mine_opt["optimizer_state_dict"]["state"][0]["step"], inner["state"][0]["step"],
                "step", problems)  # fmt: skip
        compare(mine_opt["optimizer_state_dict"]["param_groups"], want_opt["param_groups"],
                "param_groups", problems)  # fmt: skip
        keys = ("loss_scaler", "dynamic_loss_scale", "overflow", "zero_stage")
    else:
        keys = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "zero_stage",
                "group_paddings", "partition_count", "ds_version", "param_groups")  # fmt: skip
    for key in keys:
        compare(mine_opt[key], want_opt[key], f"optimizer_state.{key}", problems)
    model_file = "mp_rank_00_model_states.pt"
    if zero3:
        model_file = "zero_pp_rank_0_" + model_file
    mine_model, want_model = load(ours / model_file), load(theirs / model_file)
    for key in ("param_shapes", "buffer_names", "shared_params", "lr_scheduler", "global_steps",
                "global_samples", "skipped_steps", "ds_config", "iteration"):  # fmt: skip
        compare(mine_model[key], want_model[key], f"{model_file}.{key}", problems)
    assert problems == [], "\n".join(problems)
    # DeepSpeed's fallback folders for frozen params, buffers and aliases (never read):
    extra = {p.name for p in (theirs / "zero").iterdir()} - {
        p.name for p in (ours / "zero").iterdir()
    }
    fallback = set(manifest.params) - set(trainable) | set(manifest.buffers) | set(manifest.tied)
    assert extra == (set() if zero3 else fallback)
    assert result.nbytes == sum(manifest.params[n].numel for n in trainable) * 4 * 3
