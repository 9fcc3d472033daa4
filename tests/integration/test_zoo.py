"""DeepSpeed layouts beyond the ZeRO 1-3 grid (issue #31), made by DeepSpeed 0.19.8 itself.

ZeRO stage 0 (the optimizer saved by position in the model states: a bare torch optimizer,
``FP16_Optimizer``'s flat masters, ``FP16_UnfusedOptimizer``'s per-parameter masters, "DDP bf16")
converts to exactly the training job's own state, every position named and proven (shapes,
and masters that round to the 16-bit weights bit for bit; tests/fixtures/ds_cases.py ``ZOO``).
Loads (tests/fixtures/load_cases.py ``ZOO_LOADS``) resume engines at other world sizes and
stages, ZeRO-0 engines included, equal to the saved job's state, to DeepSpeed's own
``load_checkpoint`` where it makes the same change, and with the never-stopped run's losses
at the same layout. DeepSpeed's Muon at ZeRO-2 keeps ``momentum_buffer`` as whole copies of
the matrices each partition touches: stored per parameter, rebuilt for a Muon engine at another
layout. A store's states that are not elementwise go into a plain torch optimizer where it keeps
them (whole per parameter), are refused in one line where it has no place for them (per ZeRO
partition), and ``ucformat inspect`` lists them per parameter and per group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ucformat
import ucformat.torch as uctorch
from tests.cli.helpers import invoke
from tests.fixtures.ds_cases import ZOO
from tests.fixtures.load_cases import ZOO_LOADS
from tests.fixtures.models import BASE_LR, BASE_WEIGHT_DECAY, BETAS, EPS, build_model
from tests.fixtures.zoo_optim import Factored
from tests.truth import assert_exact, assert_step, assert_store_matches_truth, load_truth
from ucformat.errors import UnsupportedCheckpointError

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


def test_zero_offload_fixture_really_offloads(ds_grid: Path) -> None:
    """The offload case ran DeepSpeed's ZeRO-Offload (its partitions and optimizer step on the
    CPU), with the config's torch AdamW: not DeepSpeedCPUAdam, whose JIT build takes minutes
    here; the files are the same kind (docs/parallel.md)."""
    truth = load_truth(ds_grid / "z2-fp32-tadamw-simple-ws2-offload")
    assert truth["cpu_offload"] and truth["optimizer_class"] == "AdamW"


def test_muon_momentum_stored_per_parameter(ds_grid: Path, tmp_path: Path) -> None:
    """DeepSpeed's Muon at ZeRO-2: each rank's momentum_buffer holds whole copies of the
    matrices its partition touches (fc2.weight on both ranks); the store keeps one per matrix,
    elementwise, equal to the job's own (the truth cut from each rank's buffer by the wrapper's
    own params_in_partition), the biases' Adam moments beside them."""
    source = ds_grid / "z2-fp32-muon-simple-ws2"
    manifest = ucformat.convert(source / "ckpt", tmp_path / "s")
    assert manifest.optimizer is not None
    assert manifest.optimizer.state_keys == ["exp_avg", "exp_avg_sq", "momentum_buffer"]
    assert [g.params for g in manifest.optimizer.groups] == [
        ["fc1.weight", "fc2.weight", "out.weight"], ["fc1.bias", "fc2.bias", "out.bias"],
    ]  # fmt: skip
    assert sorted(manifest.params["fc2.weight"].states) == ["fp32", "momentum_buffer"]
    truth = load_truth(source)
    assert truth["optimizer_class"] == "MuonWithAuxAdam"
    assert truth["optim"]["fc2.weight"]["momentum_buffer"].abs().sum() > 0
    assert_store_matches_truth(ucformat.open(tmp_path / "s"), truth)


def _factored(model_name: str) -> tuple[torch.nn.Module, Factored]:
    model, groups = build_model(model_name, seed=98765)
    return model, Factored(groups, lr=BASE_LR, betas=BETAS, eps=EPS, weight_decay=BASE_WEIGHT_DECAY)


def test_torch_load_restores_whole_states(ds_grid: Path, tmp_path: Path) -> None:
    """A plain torch optimizer steps each parameter whole: it gets the states kept whole (the
    1-element tensors, the row and column factors) as the job held them, with the elementwise
    ones and the int step, from state_dicts() and load() alike."""
    source = ds_grid / "z0-fp32-fact-multi-ws2"
    ucformat.convert(source / "ckpt", tmp_path / "s")
    truth = load_truth(source)
    model, optimizer = _factored("multi")
    report = uctorch.load(model, optimizer, tmp_path / "s")
    assert report.skipped == []
    names = {id(p): n for n, p in model.named_parameters()}
    dumped = uctorch.state_dicts(tmp_path / "s")["optimizer"]["state"]
    index = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            name, state = names[id(param)], optimizer.state[param]
            want = {**truth["optim"][name], **truth["odd"].get(name, {})}
            assert sorted(state) == sorted([*want, "step"]), name
            for key, value in want.items():
                assert_exact(state[key], value, f"{name}/{key}")
                assert_exact(dumped[index][key], value, f"state_dicts {name}/{key}")
            assert_step(state["step"], truth["step"][name], f"{name}/step")
            index += 1
    assert truth["odd"]["a.weight"]["row"].shape == (5,)


def test_torch_load_refuses_states_per_zero_partition(ds_grid: Path, tmp_path: Path) -> None:
    """A state kept once per ZeRO partition belongs to no parameter: refused in one line before
    anything changes; strict=False loads the rest and says what it left out."""
    ucformat.convert(ds_grid / "z2-fp32-fact-simple-ws2" / "ckpt", tmp_path / "s")
    model, optimizer = _factored("simple")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedCheckpointError) as info:
        uctorch.load(model, optimizer, tmp_path / "s")
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        "optimizer group 0's state 'peak' (kept once per ZeRO partition, 2 partitions, shape "
        "[1]) (1 more such states) has no place in a torch optimizer's per-parameter state"
    )
    assert message.endswith("pass strict=False to load the rest without it. Nothing was loaded.")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not optimizer.state
    with pytest.raises(UnsupportedCheckpointError):
        uctorch.state_dicts(tmp_path / "s")
    report = uctorch.load(model, optimizer, tmp_path / "s", strict=False)
    assert [s.split(" (")[0] for s in report.skipped] == [
        "optimizer group 0's state 'peak'", "optimizer group 0's state 'tensor_step'",
    ]  # fmt: skip
    truth = load_truth(ds_grid / "z2-fp32-fact-simple-ws2")
    fc1 = dict(model.named_parameters())["fc1.weight"]
    assert_exact(optimizer.state[fc1]["exp_avg"], truth["optim"]["fc1.weight"]["exp_avg"], "fc1")


def test_inspect_lists_states_kept_whole_and_per_partition(ds_grid: Path, tmp_path: Path) -> None:
    """inspect shows each parameter's whole states with their own shapes, the optimizer's whole
    and per-partition keys, each group's per-partition states, and counts their bytes."""
    ucformat.convert(ds_grid / "z0-fp32-fact-multi-ws2" / "ckpt", tmp_path / "whole")
    shown = invoke("inspect", tmp_path / "whole").stdout
    assert (
        "optimizer: unknown, states exp_avg, exp_avg_sq; scalars step; whole per parameter: "
        "col, peak, row, tensor_step\n"
    ) in shown
    row = next(line for line in shown.splitlines() if line.startswith("a.weight "))
    assert (
        "fp32, exp_avg, tensor_step (whole 1), peak (whole 1), row (whole 5), col (whole 7), step"
    ) in row
    assert row.endswith(" 336 B")  # fp32 and exp_avg: 2 x 35 x 4 B; the whole states 14 x 4 B
    ucformat.convert(ds_grid / "z2-fp32-fact-simple-ws2" / "ckpt", tmp_path / "part")
    shown = invoke("inspect", tmp_path / "part").stdout
    assert "once per ZeRO partition: tensor_step (group 0), peak (group 0)\n" in shown
    assert "states per ZeRO partition" in shown
    assert "  tensor_step 1 x 2 partitions (equal); peak 1 x 2 partitions\n" in shown


def test_sharded_torch_optimizers_refuse_whole_states(ds_grid: Path, tmp_path: Path) -> None:
    """A sharded (DTensor) model's optimizer steps each rank's shard: a state kept whole has
    no place there (the decision ucformat.torch.load takes before reading, on every rank)."""
    from ucformat.torch.odd_states import odd_states_left_out

    manifest = ucformat.convert(ds_grid / "z0-fp32-fact-multi-ws2" / "ckpt", tmp_path / "s")
    assert odd_states_left_out(manifest, sharded=False, strict=True) == []
    with pytest.raises(UnsupportedCheckpointError) as info:
        odd_states_left_out(manifest, sharded=True, strict=True)
    assert str(info.value).startswith(
        "param 'a.weight''s state 'col' (kept whole, shape [7]) (21 more such states) has no "
        "place in a torch optimizer's per-parameter state: this model's optimizer steps each "
        "rank's shard of the parameter; a plain model on one process or a ZeRO-0 DeepSpeed "
        "engine takes it; pass strict=False"
    )
    left = odd_states_left_out(manifest, sharded=True, strict=False, names={"c.bias"})
    assert left == [
        "param 'c.bias''s state 'peak' (kept whole, shape [1])",
        "param 'c.bias''s state 'tensor_step' (kept whole, shape [1])",
    ]
