"""DeepSpeed layouts beyond the ZeRO 1-3 grid (issue #31), made by DeepSpeed 0.19.8 itself.

ZeRO stage 0 (the optimizer saved by position in the model states: a bare torch optimizer,
``FP16_Optimizer``'s flat masters, ``FP16_UnfusedOptimizer``'s per-parameter masters, "DDP bf16")
converts to exactly the training job's own state, every position named and proven (shapes,
and masters that round to the 16-bit weights bit for bit; tests/fixtures/ds_cases.py ``ZOO``).
Loads (tests/fixtures/load_cases.py ``ZOO_LOADS``) resume engines at other world sizes and
stages, ZeRO-0 engines included, equal to the saved job's state, to DeepSpeed's own
``load_checkpoint`` where it makes the same change, and with the never-stopped run's losses
at the same layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ucformat
from tests.fixtures.ds_cases import ZOO
from tests.fixtures.load_cases import ZOO_LOADS
from tests.truth import assert_store_matches_truth, load_truth

pytestmark = pytest.mark.deepspeed

ZERO0 = [c.name for c in ZOO if c.stage == 0]
WRAPPERS = {
    "z0-fp32-tadam-multi-ws2": "none",
    "z0-fp16-dsadam-simple-ws2": "FP16_Optimizer",
    "z0-fp16-tadam-ftb-ws2": "FP16_UnfusedOptimizer",
    "z0-bf16-tadamw-multi-ws2": "FP16_UnfusedOptimizer",
    "z0-fp32-fact-multi-ws2": "none",
}


@pytest.mark.parametrize("case", [c.name for c in ZOO])
def test_zoo_case_converts_exactly(case: str, ds_grid: Path, tmp_path: Path) -> None:
    """Every master, optimizer state (elementwise, whole, per partition), scalar, counter,
    buffer and frozen value equals the training job's own; Ulysses SP, ZeRO-Offload and hpZ
    are ordinary ZeRO checkpoints over their partition ranks."""
    source = ds_grid / case
    manifest = ucformat.convert(source / "ckpt", tmp_path / "store")
    if case in ZERO0:
        assert manifest.source.zero_stage == 0
        assert manifest.source.optimizer_wrapper == WRAPPERS[case]
    assert_store_matches_truth(ucformat.open(tmp_path / "store"), load_truth(source))


def test_zero0_fp16_records_the_wrappers_loss_scale(ds_grid: Path, tmp_path: Path) -> None:
    manifest = ucformat.convert(ds_grid / "z0-fp16-dsadam-simple-ws2" / "ckpt", tmp_path / "s")
    scaler = manifest.progress.loss_scaler
    assert scaler is not None and scaler.class_name == "LossScaleConfig" and scaler.dynamic
    assert manifest.progress.clip_grad == 1.0


def test_states_kept_whole_per_parameter_as_saved(ds_grid: Path, tmp_path: Path) -> None:
    """ZeRO-0, an optimizer with a 1-element tensor, an int and Adafactor-style factors: the
    factors and tensors keep their own shapes (format 3.1 whole_states), exactly."""
    manifest = ucformat.convert(ds_grid / "z0-fp32-fact-multi-ws2" / "ckpt", tmp_path / "s")
    assert manifest.format_version == "3.1"
    assert manifest.optimizer is not None
    assert manifest.optimizer.whole_keys == ["col", "peak", "row", "tensor_step"]
    assert manifest.optimizer.state_keys == ["exp_avg", "exp_avg_sq"]
    weight = manifest.params["a.weight"]  # Linear(7, 5)
    assert {k: r.shape for k, r in weight.whole_states.items()} == {
        "tensor_step": [1], "peak": [1], "row": [5], "col": [7],
    }  # fmt: skip
    assert sorted(weight.states) == ["exp_avg", "fp32"]  # no exp_avg_sq: factored
    assert weight.scalars["step"].kind == "int"
    assert sorted(manifest.params["a.bias"].states) == ["exp_avg", "exp_avg_sq", "fp32"]
    assert ucformat.verify(tmp_path / "s").ok


def test_states_kept_per_partition_as_saved(ds_grid: Path, tmp_path: Path) -> None:
    """ZeRO-2, the same optimizer: its 1-element tensors are the partition's, one per rank
    (format 3.1 partition_states); 'tensor_step' is equal on both ranks, 'peak' is not."""
    manifest = ucformat.convert(ds_grid / "z2-fp32-fact-simple-ws2" / "ckpt", tmp_path / "s")
    assert manifest.format_version == "3.1" and manifest.optimizer is not None
    states = manifest.optimizer.groups[0].partition_states
    assert sorted(states) == ["peak", "tensor_step"]
    assert states["tensor_step"].replicated and not states["peak"].replicated
    assert states["peak"].partitions == 2 and states["peak"].shape == [1]
    peak = states["peak"].array  # stored in a stack (format 3.1): one row per partition
    assert peak.path.startswith("stacks/") and peak.stack is not None
    assert peak.shape == [2, 1] and peak.dtype == "float32"
    assert_store_matches_truth(
        ucformat.open(tmp_path / "s"), load_truth(ds_grid / "z2-fp32-fact-simple-ws2")
    )
    assert ucformat.verify(tmp_path / "s", against=ds_grid / "z2-fp32-fact-simple-ws2" / "ckpt").ok


@pytest.mark.parametrize("name", [load.name for load in ZOO_LOADS])
def test_zoo_loads(name: str, ds_loads: dict[str, dict[str, Any]]) -> None:
    result = ds_loads[name]
    assert result["failures"] == [], "\n".join(result["failures"])
