"""DeepSpeed native MoE (``deepspeed.moe.layer.MoE``) checkpoints in and out.

The checkpoints are written by DeepSpeed itself (tests/fixtures/moe_cases.py: ep2 at W=2 and
ep2 x dp2 at W=4, top-1 and top-2 gating, ZeRO-0/1/2, one ep1 run), each with the training job's
own gathered state under global expert names (``truth.pt``). There is no DeepSpeed oracle:
``ds_to_universal`` fails on these checkpoints.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ucformat
from tests.conftest import deepspeed_available
from tests.fixtures.moe_cases import CASES, generate_moe

pytestmark = pytest.mark.skipif(not deepspeed_available(), reason="DeepSpeed is not installed")

EXPERTS = ".deepspeed_experts."


@pytest.fixture(scope="module")
def moe_cases() -> dict[str, Path]:
    return generate_moe()


@pytest.fixture(scope="module")
def moe_stores(
    moe_cases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("moe")
    stores = {}
    for name, folder in moe_cases.items():
        stores[name] = work / f"{name}.ucf"
        ucformat.convert(folder / "ckpt", stores[name])
    return stores


def _truth(folder: Path) -> dict[str, Any]:
    truth: dict[str, Any] = torch.load(folder / "truth.pt", weights_only=True)
    return truth


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_every_expert_state_equals_the_training_jobs_own(
    name: str, moe_cases: dict[str, Path], moe_stores: dict[str, Path]
) -> None:
    case = next(c for c in CASES if c.name == name)
    truth = _truth(moe_cases[name])["params"]
    ckpt = ucformat.open(moe_stores[name])
    manifest = ckpt.manifest
    assert set(manifest.params) == set(truth)
    experts = [n for n in truth if EXPERTS in n]
    assert len(experts) == 2 * 4 * 4  # 2 layers x 4 global experts x 4 params
    for pname, states in truth.items():
        for key, want in states.items():
            got = ckpt.read(pname, key)
            if key == "step":
                assert float(got) == float(want), (pname, key)
            else:
                assert torch.equal(torch.as_tensor(got).reshape(want.shape), want), (pname, key)
    assert manifest.source.zero_stage == case.stage
    assert manifest.source.world_size == case.world_size
    assert manifest.experts is not None
    assert manifest.experts.ep_size == case.ep_size
    assert [layer.num_experts for layer in manifest.experts.layers] == [4, 4]
    assert sorted(manifest.experts.param_names()) == sorted(experts)
    assert [layer.gate for layer in manifest.experts.layers] == [
        "moe1.deepspeed_moe.gate.wg.weight",
        "moe2.deepspeed_moe.gate.wg.weight",
    ]


def test_distinct_experts_are_not_swapped(moe_cases: dict[str, Path]) -> None:
    """The fixture is able to catch a local/global mix-up: EP ranks' experts differ."""
    truth = _truth(moe_cases["ep2-z1-top2-ws2"])["params"]
    prefix = "moe1.deepspeed_moe.experts.deepspeed_experts"
    first = truth[f"{prefix}.0.up.weight"]["fp32"]
    third = truth[f"{prefix}.2.up.weight"]["fp32"]
    assert not torch.equal(first, third)


#: (source case, target world size, target ep_size, target ZeRO stage)
LOADS: tuple[tuple[str, int, int, int], ...] = (
    ("ep2-z1-top2-ws2", 2, 1, 1),  # ep2 -> ep1
    ("ep1-z1-top1-ws2", 2, 2, 2),  # ep1 -> ep2
    ("ep2-z2-top2-ws4", 2, 2, 1),  # ep2 x dp2 -> ep2 x dp1
    ("ep2-z0-top1-ws2", 4, 2, 2),  # ep2 x dp1 (ZeRO-0) -> ep2 x dp2
    ("ep2-z2-top2-ws4", 4, 4, 1),  # ep2 -> ep4
    ("ep2-z1-top2-ws2", 2, 1, 0),  # ep2 -> ep1 x dp2 into a ZeRO-0 engine
    ("ep2-z2-top2-ws4", 4, 4, 0),  # ep2 x dp2 -> ep4 into a ZeRO-0 engine
    ("ep2-z0-fp16-top1-ws2", 2, 2, 0),  # ZeRO-0 fp16 (masters by position): the same layout
    ("ep2-z0-fp16-top1-ws2", 4, 2, 0),  # ZeRO-0 fp16: ep2 x dp1 -> ep2 x dp2
)


#: Native exports (``ucformat export deepspeed --ep-size``) that a stock ``load_checkpoint``
#: loads: (source case, target world size, target ep_size, target ZeRO stage).
NATIVE: tuple[tuple[str, int, int, int], ...] = (
    ("ep2-z2-top2-ws4", 2, 1, 1),  # ep2 x dp2 -> ep1 x dp2
    ("ep2-z1-top2-ws2", 4, 2, 2),  # ep2 x dp1 -> ep2 x dp2, ZeRO-1 -> 2
    ("ep1-z1-top1-ws2", 2, 2, 1),  # ep1 -> ep2
    ("ep2-z2-top2-ws4", 2, 1, 0),  # ep2 x dp2 -> ep1 x dp2 at ZeRO-0 (expp_rank_* files)
    ("ep2-z1-top2-ws2", 4, 2, 0),  # ep2 x dp1 -> ep2 x dp2 at ZeRO-0
)


def _load_name(load: tuple[str, int, int, int]) -> str:
    source, world, ep, stage = load
    return f"{source}-to-ep{ep}-z{stage}-ws{world}"


def _native_name(load: tuple[str, int, int, int]) -> str:
    return f"native-{_load_name(load)}"


@pytest.fixture(scope="module")
def moe_loads(
    moe_cases: dict[str, Path],
    moe_stores: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    from tests.cli.helpers import invoke
    from tests.fixtures.moe_cases import run_moe_loads

    work = tmp_path_factory.mktemp("moe-loads")
    jobs = []
    for load, native in [(load, False) for load in LOADS] + [(load, True) for load in NATIVE]:
        source, world, ep, stage = load
        case = next(c for c in CASES if c.name == source)
        name = _native_name(load) if native else _load_name(load)
        target = {
            "name": name, "world_size": world, "ep_size": ep, "stage": stage, "k": case.k,
            "dtype": case.dtype,
        }  # fmt: skip
        job = {
            "name": name,
            "case": {**target, "steps": case.steps},
            "store": str(moe_stores[source]),
            "truth": str(moe_cases[source] / "truth.pt"),
            "first_step": case.steps,
        }
        if native:
            out = work / "native" / name
            args = ("--world-size", str(world), "--stage", str(stage), "--ep-size", str(ep))
            result = invoke("export", "deepspeed", moe_stores[source], out, *args)
            assert result.exit_code == 0, result.stderr
            job["native"] = str(out)
        jobs.append(job)
    return run_moe_loads(jobs, work)


@pytest.mark.parametrize("load", LOADS, ids=_load_name)
def test_resume_at_another_ep_and_dp_is_exact_and_continues_the_run(
    load: tuple[str, int, int, int],
    moe_loads: dict[str, dict[str, Any]],
    moe_stores: dict[str, Path],
) -> None:
    """Every state the rank holds equals the source job's (exact), the next losses equal the
    uninterrupted run's, and each rank read its experts and ZeRO partition only."""
    source, world, ep, _ = load
    ranks = moe_loads[_load_name(load)]["ranks"]
    assert len(ranks) == world
    manifest = ucformat.open(moe_stores[source]).manifest
    experts = sum(4 * 3 * p.numel for n, p in manifest.params.items() if EXPERTS in n)
    dense = sum(4 * 3 * p.numel for n, p in manifest.params.items() if EXPERTS not in n)
    for rank in ranks:
        assert rank["failures"] == []
        assert 0 < rank["bytes_needed"] <= rank["bytes_read"]
        # its own experts (1/ep of them, or a ZeRO part of those) and at most the dense params:
        # whole chunks of those arrays at most (+ 24 index bytes per array read), nothing of the
        # other EP ranks' experts (ep2: 10 KiB more)
        index = 24 * 3 * len(manifest.params)
        assert rank["bytes_read"] <= dense + experts // ep + index, (rank, dense, experts)


def test_inspect_shows_experts_as_layer_by_experts_by_shape(moe_stores: dict[str, Path]) -> None:
    from tests.cli.helpers import invoke

    result = invoke("inspect", moe_stores["ep2-z1-top2-ws2"])
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "moe1.deepspeed_moe.experts.deepspeed_experts.[0-3].up.weight    4x12x8" in out
    assert "deepspeed_experts.3.up.weight" not in out
    assert "experts: 2 MoE layers x 4 experts, 32 expert params" in out
    rows = [ln for ln in out.splitlines() if "float32  " in ln]
    assert len(rows) == 8 + 2 * 4  # dense params + (layer x per-expert param)
    one = invoke("inspect", moe_stores["ep2-z1-top2-ws2"], "--param", "*experts.3.up.weight")
    assert "moe2.deepspeed_moe.experts.deepspeed_experts.3.up.weight" in one.stdout


def _copy(folder: Path, tmp_path: Path) -> Path:
    tag = tmp_path / "global_step3"
    shutil.copytree(folder / "ckpt" / "global_step3", tag)
    return tag


@pytest.mark.parametrize(
    ("rename", "fragments"),
    [
        (
            "layer_0_expert_1_mp_rank_01_model_states.pt",
            ("tensor-parallel expert files (layer_0_expert_1_mp_rank_01_model_states.pt)",),
        ),
        (
            "expert_1_mp_rank_00_model_states.pt",
            ("unsupported layout (expert_1_mp_rank_00_model_states.pt)", "Megatron-DeepSpeed"),
        ),
    ],
)
def test_out_of_scope_expert_layouts_are_refused_in_one_line_naming_the_files(
    rename: str, fragments: tuple[str, ...], moe_cases: dict[str, Path], tmp_path: Path
) -> None:
    from tests.cli.helpers import assert_user_error, invoke

    tag = _copy(moe_cases["ep2-z1-top2-ws2"], tmp_path)
    (tag / "layer_0_expert_1_mp_rank_00_model_states.pt").rename(tag / rename)
    assert_user_error(invoke("convert", tag, tmp_path / "out.ucf"), *fragments)
    assert not (tmp_path / "out.ucf").exists()


def test_autoep_and_missing_expert_files_are_refused(
    moe_cases: dict[str, Path], tmp_path: Path
) -> None:
    from tests.cli.helpers import assert_user_error, invoke

    tag = _copy(moe_cases["ep2-z2-top1-ws2"], tmp_path)
    model = tag / "mp_rank_00_model_states.pt"
    meta = torch.load(model, weights_only=False)
    meta["ds_autoep_layers"] = [{"moe_layer_id": 0}]
    torch.save(meta, model)
    assert_user_error(invoke("convert", tag, tmp_path / "a.ucf"), "AutoEP", str(model))
    tag2 = _copy(moe_cases["ep2-z2-top1-ws2"], tmp_path / "b")
    (tag2 / "layer_1_expert_2_mp_rank_00_model_states.pt").unlink()
    assert_user_error(invoke("convert", tag2, tmp_path / "b.ucf"), "no file for expert(s) [2]")


def test_safetensors_export_names_experts_by_global_id(
    moe_cases: dict[str, Path], moe_stores: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from tests.cli.helpers import invoke

    result = invoke("export", "safetensors", moe_stores["ep2-z2-top2-ws4"], tmp_path / "hf")
    assert result.exit_code == 0, result.stderr
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted((tmp_path / "hf").glob("*.safetensors")):
        tensors.update(load_file(path))
    truth = _truth(moe_cases["ep2-z2-top2-ws4"])["params"]
    assert set(tensors) == set(truth)
    for name, states in truth.items():
        assert torch.equal(tensors[name], states["fp32"]), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_an_ep2_store_loads_into_the_same_network_without_expert_parallelism(
    moe_cases: dict[str, Path], moe_stores: dict[str, Path]
) -> None:
    """Global names are those of an ep_size 1 model: ucformat.torch.load needs nothing more."""
    from tests.fixtures._moe_worker import MoeNet

    model = MoeNet(1, 2)
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if EXPERTS not in n]},
            {"params": [p for n, p in named if EXPERTS in n]},
        ],
        lr=1e-2,
    )
    ucformat.torch.load(model, optimizer, moe_stores["ep2-z2-top2-ws4"])
    truth = _truth(moe_cases["ep2-z2-top2-ws4"])["params"]
    for name, param in named:
        assert torch.equal(param.detach(), truth[name]["fp32"]), name
        assert torch.equal(optimizer.state[param]["exp_avg_sq"], truth[name]["exp_avg_sq"]), name


@pytest.mark.parametrize("load", NATIVE, ids=_native_name)
def test_native_moe_export_resumes_in_a_stock_engine_at_another_ep_and_dp(
    load: tuple[str, int, int, int], moe_loads: dict[str, dict[str, Any]]
) -> None:
    """DeepSpeed's own load_checkpoint of the export: every state the rank holds equals the
    source job's (exact) and the next losses equal the uninterrupted run's."""
    ranks = moe_loads[_native_name(load)]["ranks"]
    assert len(ranks) == load[1]
    assert all(rank["failures"] == [] for rank in ranks), ranks


def test_native_moe_export_writes_deepspeeds_file_names(
    moe_stores: dict[str, Path], tmp_path: Path
) -> None:
    from tests.cli.helpers import invoke

    args = ("--world-size", "4", "--stage", "1", "--ep-size", "4")
    result = invoke("export", "deepspeed", moe_stores["ep2-z1-top2-ws2"], tmp_path / "o", *args)
    assert result.exit_code == 0, result.stderr
    tag = tmp_path / "o" / "global_step3"
    names = sorted(p.name for p in tag.iterdir())
    experts = [f"layer_{i}_expert_{e}_mp_rank_00_model_states.pt" for i in (0, 1) for e in range(4)]
    ranks = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)]
    assert names == sorted([*experts, "mp_rank_00_model_states.pt", *ranks])
    expert = torch.load(tag / "layer_1_expert_3_mp_rank_00_model_states.pt", weights_only=True)
    assert sorted(expert) == sorted(
        f"moe2.deepspeed_moe.experts.deepspeed_experts.3.{p}"
        for p in ("up.weight", "up.bias", "down.weight", "down.bias")
    )
    optim = torch.load(tag / ranks[3], weights_only=False)["optimizer_state_dict"]
    assert optim["partition_count"] == [4, 1]
    assert optim["base_optimizer_state"]["param_groups"][1]["name"] == "ep_size_4"
    local = list(optim["param_slice_mappings"][1])  # EP rank 3's experts under local ids
    assert local[0] == "moe1.deepspeed_moe.experts.deepspeed_experts.0.up.weight"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--stage", "3", "--ep-size", "2"), "ZeRO stage 3 targets are not written"),
        (("--stage", "1", "--ep-size", "3"), "ep_size 3 does not divide"),
    ],
)
def test_native_moe_exports_it_cannot_write_are_refused_in_one_line(
    args: tuple[str, ...], fragment: str, moe_stores: dict[str, Path], tmp_path: Path
) -> None:
    from tests.cli.helpers import assert_user_error, invoke

    store = moe_stores["ep2-z1-top2-ws2"]
    result = invoke("export", "deepspeed", store, tmp_path / "out", "--world-size", "6", *args)
    assert_user_error(result, "'export deepspeed' of an MoE store", fragment)
    assert not (tmp_path / "out" / "latest").exists()


def test_native_moe_export_to_a_url_is_refused_in_one_line(moe_stores: dict[str, Path]) -> None:
    from tests.cli.helpers import assert_user_error, invoke

    store = moe_stores["ep2-z1-top2-ws2"]
    result = invoke("export", "deepspeed", store, "s3://bucket/run", "--world-size", "2",
                    "--stage", "1")  # fmt: skip
    assert_user_error(result, "'export deepspeed' of an MoE store", "not to a URL")


def test_universal_exports_of_moe_stores_are_refused_in_one_line(
    moe_stores: dict[str, Path], tmp_path: Path
) -> None:
    from tests.cli.helpers import assert_user_error, invoke

    result = invoke("export", "deepspeed-universal", moe_stores["ep2-z1-top2-ws2"], tmp_path / "o")
    assert_user_error(result, "'export deepspeed-universal'", "2 MoE layers (source ep_size 2)")
