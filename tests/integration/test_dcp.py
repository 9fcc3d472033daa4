"""PyTorch Distributed Checkpoints in and out, with real FSDP2, stock DCP and real DeepSpeed.

* FSDP2 at W=2 -> stock ``dcp.save`` (flat, nested and torchtitan layouts) -> ``ucformat
  convert`` -> DeepSpeed ZeRO-2 at W=3 via ``ucformat.deepspeed.load``: every gathered fp32
  param, Adam state and step bit-exact against the FSDP2 job's gathered state;
* converted DeepSpeed grid stores -> ``ucformat export dcp`` -> stock ``dcp.load`` +
  ``set_state_dict`` into FSDP2 at W=1, 3 and 4: bit-exact against the grid case's truth.

Three torchrun launches in all (W=1, 3, 4), plus the cached FSDP2 save (W=2).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

import ucformat
from tests.conftest import deepspeed_available
from tests.fixtures.dcp_cases import LAYOUTS, generate_dcp, run_dcp_jobs
from tests.fixtures.ds_cases import Case
from tests.truth import assert_exact
from ucformat.export import export_dcp

pytestmark = pytest.mark.skipif(not deepspeed_available(), reason="DeepSpeed is not installed")

SOURCE = "fsdp2-multi-ws2"
TARGET = Case(
    name="dcp-target-z2-ws3", stage=2, dtype="fp32", optimizer="torch_adam", model="multi",
    world_size=3,
)  # fmt: skip
#: (grid case, export world size, optimizer layout, FSDP2 world sizes that load it)
EXPORTS: tuple[tuple[str, int | None, str, tuple[int, ...]], ...] = (
    ("z2-fp32-tadam-multi-ws4", None, "flat", (1, 3, 4)),
    ("z3-bf16-tadam-simple-ws2", 3, "nested", (1, 3, 4)),
    ("z1-fp32-tadam-simple-ws3", 1, "flat", (3,)),
)


@pytest.fixture(scope="module")
def dcp_sources() -> dict[str, Path]:
    return generate_dcp()


@pytest.fixture(scope="module")
def dcp_runs(
    dcp_sources: dict[str, Path], ds_grid: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """Every torchrun job of this module, run once."""
    work = tmp_path_factory.mktemp("dcp")
    jobs: list[dict[str, Any]] = []
    source = dcp_sources[SOURCE]
    for layout in LAYOUTS:
        store = work / f"{SOURCE}-{layout}.ucf"
        ucformat.convert(source / layout, store)
        jobs.append({
            "kind": "ds-load", "name": f"{SOURCE}-{layout}-to-z2-ws3", "world_size": 3,
            "store": str(store), "truth": str(source / "truth.pt"), "target": asdict(TARGET),
        })  # fmt: skip
    for case, export_ws, layout, loads in EXPORTS:
        store = work / f"{case}.ucf"
        ucformat.convert(ds_grid / case / "ckpt", store)
        out = work / f"{case}-dcp"
        export_dcp(
            store, out, world_size=export_ws, layout="nested" if layout == "nested" else "flat"
        )
        for world_size in loads:
            jobs.append({
                "kind": "fsdp-load", "name": f"{case}-dcp-{layout}-fsdp2-ws{world_size}",
                "world_size": world_size, "dcp": str(out), "layout": layout,
                "model": case.split("-")[3], "truth": str(ds_grid / case / "truth.pt"),
            })  # fmt: skip
    return run_dcp_jobs(jobs, work)


DS_LOADS = [f"{SOURCE}-{layout}-to-z2-ws3" for layout in LAYOUTS]
FSDP_LOADS = [
    f"{case}-dcp-{layout}-fsdp2-ws{ws}" for case, _, layout, loads in EXPORTS for ws in loads
]


@pytest.mark.parametrize("name", DS_LOADS)
def test_fsdp2_dcp_converted_loads_into_deepspeed_bit_exact(
    dcp_runs: dict[str, dict[str, Any]], name: str
) -> None:
    assert dcp_runs[name]["failures"] == []


@pytest.mark.parametrize("name", FSDP_LOADS)
def test_exported_dcp_loads_into_fsdp2_with_stock_dcp_bit_exact(
    dcp_runs: dict[str, dict[str, Any]], name: str
) -> None:
    assert dcp_runs[name]["failures"] == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_converted_dcp_store_holds_the_fsdp2_state(
    dcp_sources: dict[str, Path], tmp_path: Path, layout: str
) -> None:
    """The store itself (no DeepSpeed): arrays, steps, groups and provenance."""
    source = dcp_sources[SOURCE]
    truth = torch.load(source / "truth.pt", weights_only=True)
    manifest = ucformat.convert(source / layout, tmp_path / "s.ucf")
    ckpt = ucformat.open(tmp_path / "s.ucf")
    assert set(manifest.params) == set(truth["fp32"])
    for name, want in truth["fp32"].items():
        assert_exact(ckpt.read(name, "fp32"), want, f"{name}/fp32")
        for key, value in truth["optim"][name].items():
            assert_exact(ckpt.read(name, key), value, f"{name}/{key}")
        assert_exact(ckpt.read(name, "step"), truth["step"][name], f"{name}/step")
    assert manifest.optimizer is not None
    groups = [group.params for group in manifest.optimizer.groups]
    assert groups == [["c.weight", "b.weight", "a.weight"],
                      ["a.bias", "b.bias", "ln.weight", "ln.bias", "c.bias"]]  # fmt: skip
    assert [group.hyperparams["lr"] for group in manifest.optimizer.groups] == [1e-3, 2e-3]
    assert manifest.optimizer.name == "torch.optim.Adam"
    src = manifest.source
    assert (src.framework, src.checkpoint_format, src.written_by) == (
        "pytorch",
        "torch-dcp",
        "convert",
    )
    assert src.world_size == 2 and src.zero_stage is None
    assert {f.name for f in src.files} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    if layout == "titan":
        assert manifest.client_state.values == {"train_state.step": 3}
    # torchtitan's train_state.step, else the optimizer's steps (as ucformat.torch.save records)
    assert manifest.progress.global_steps == max(int(v) for v in truth["step"].values()) == 3
    report = ucformat.verify(tmp_path / "s.ucf", against=source / layout)
    assert report.ok, report


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("layout", ["flat", "nested"])
def test_exported_dcp_loads_frozen_tied_and_buffers_into_a_plain_model(
    ds_grid: Path, tmp_path: Path, layout: str
) -> None:
    """Single process, stock ``dcp.load``: frozen params, a tied head and BatchNorm buffers."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from tests.fixtures.models import build_model
    from tests.truth import load_truth

    case = ds_grid / "z2-fp32-tadam-ftb-ws2"
    ucformat.convert(case / "ckpt", tmp_path / "s.ucf")
    result = export_dcp(
        tmp_path / "s.ucf", tmp_path / "dcp", layout="nested" if layout == "nested" else "flat"
    )
    assert any("frozen params" in note for note in result.notes)
    model, groups = build_model("ftb", seed=5)
    optimizer = torch.optim.Adam(groups)
    options = StateDictOptions(flatten_optimizer_state_dict=layout == "flat")
    weights, optim = get_state_dict(model, optimizer, options=options)
    dcp_load({"model": weights, "optimizer": optim}, checkpoint_id=tmp_path / "dcp")
    set_state_dict(
        model, optimizer, model_state_dict=weights, optim_state_dict=optim, options=options
    )
    truth = load_truth(case)
    params = dict(model.named_parameters())
    for name, want in truth["fp32"].items():
        assert_exact(params[name].detach(), want, name)
        for key, value in truth["optim"][name].items():
            assert_exact(optimizer.state[params[name]][key], value, f"{name}/{key}")
        assert_exact(optimizer.state[params[name]]["step"], truth["step"][name], f"{name}/step")
    state = model.state_dict()
    for name, want in {**truth["buffers"], **truth["frozen"]}.items():
        assert_exact(state[name], want, name)
    assert model.get_submodule("lm_head").weight is model.get_submodule("emb").weight


@pytest.mark.parametrize("folder", ["2d", "1d"])
def test_dtensor_chunks_2d_uneven_and_empty_are_assembled(
    dcp_sources: dict[str, Path], tmp_path: Path, folder: str
) -> None:
    """Stock ``dcp.save`` of DTensors on a 2x2 mesh (2-D chunks) and a 4-rank 1-D mesh (uneven
    and empty chunks), model weights only."""
    source = dcp_sources["dtensor-multi-ws4"]
    truth = torch.load(source / "truth.pt", weights_only=True)
    manifest = ucformat.convert(source / folder, tmp_path / "s.ucf")
    assert manifest.optimizer is None and manifest.source.world_size == 4
    ckpt = ucformat.open(tmp_path / "s.ucf")
    assert set(manifest.params) == set(truth["fp32"])
    for name, want in truth["fp32"].items():
        assert_exact(ckpt.read(name, "fp32"), want, name)
        assert manifest.params[name].requires_grad and manifest.params[name].group is None
