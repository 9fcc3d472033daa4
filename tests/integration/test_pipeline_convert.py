"""DeepSpeed PipelineModule checkpoints (pp2 x dp1/dp2 and pp4, ZeRO-0/1, fp32/fp16/bf16, tied or
not),
made by DeepSpeed itself, converted by ``ucformat.convert`` and compared array by array with
DeepSpeed's own ``ds_to_universal`` output (ZeRO-1; it fails on ZeRO-0 ``BF16_Optimizer``
pipelines, whose model states have no ``param_shapes``) and with the training job's own
gathered state (every case; tests/fixtures/pp_cases.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ucformat
import ucformat.torch as uctorch
from tests.conftest import deepspeed_available
from tests.fixtures.pp_cases import CASES, by_name
from ucformat.errors import LayoutMismatchError
from ucformat.format.summary import summarize

pytestmark = pytest.mark.deepspeed

#: Tensor-parallel cases (``mp > 1``): tests/integration/test_pipeline_tp.py.
#: ZeRO-0 pipelines in bf16 write BF16_Optimizer's shards; in fp32 and fp16 each stage saves its
#: optimizer by position in its model states (named from the layer files: .pipeline_zero0).
CONVERTIBLE = [c.name for c in CASES if not c.tied_bias and c.mp == 1]
#: ds_to_universal fails on ZeRO-0 pipelines (bf16: "param_shapes must contain dictionaries";
#: fp32/fp16: ``FileNotFoundError: can't find *_optim_states.pt files``), and on
#: the pp4 one (``ZeroDivisionError`` in ``_build_transformer_file_map``: its last stage holds
#: only the tied head, no layer file).
UNIVERSAL = [c for c in CONVERTIBLE if by_name(c).stage == 1 and by_name(c).pp < 4]
STATES = ("fp32", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def pipeline_cases() -> dict[str, Path]:
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    from tests.fixtures.pp_cases import generate_pipeline

    return generate_pipeline()


@pytest.fixture(scope="module")
def universal(pipeline_cases: dict[str, Path]) -> dict[str, Path]:
    from tests.fixtures.pp_cases import to_universal

    return to_universal({name: pipeline_cases[name] for name in UNIVERSAL})


def _universal_params(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    tag = (folder / "latest_universal").read_text().strip()
    zero = folder / tag / "zero"
    params: dict[str, dict[str, torch.Tensor]] = {}
    for param in sorted(p for p in zero.iterdir() if p.is_dir()):
        params[param.name] = {}
        for file in sorted(param.glob("*.pt")):
            value = torch.load(file, weights_only=False)
            params[param.name][file.stem] = value["param"] if isinstance(value, dict) else value
    return params


def _positional(case: str) -> bool:
    """A ZeRO-0 pipeline whose stages save their optimizer by position (not bf16)."""
    spec = by_name(case)
    return spec.stage == 0 and spec.dtype != "bf16"


def _stored_name(name: str, positional: bool) -> str:
    """ZeRO-0 keeps no tied key: the tied module is stored under its first layer (0)."""
    if positional and name.startswith("tied_modules.embed."):
        return "0." + name.rpartition(".")[2]
    return name


def _truth(
    folder: Path, stages: int, positional: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """The training job's gathered state; a tied param's stage copies must agree."""
    truth: dict[str, dict[str, torch.Tensor]] = {}
    for stage in range(stages):
        for name, states in torch.load(folder / f"truth-stage{stage}.pt").items():
            name = _stored_name(name, positional)
            if name in truth:
                assert all(torch.equal(truth[name][k], v) for k, v in states.items()), name
            truth[name] = states
    return truth


def _check_store(store: Path, want: dict[str, dict[str, torch.Tensor]]) -> None:
    ckpt = ucformat.open(store)
    assert sorted(ckpt.manifest.params) == sorted(want)
    for name, states in want.items():
        for state in STATES:
            got = ckpt.read(name, state)
            assert got.dtype == torch.float32, (name, state)
            assert torch.equal(got, states[state].reshape(got.shape)), (name, state)
        if "step" in states:
            assert float(ckpt.read(name, "step")) == float(states["step"]), name


@pytest.mark.parametrize("case", CONVERTIBLE)
def test_pipeline_converts_like_the_training_job_holds_it(
    case: str, pipeline_cases: dict[str, Path], tmp_path: Path
) -> None:
    spec = by_name(case)
    manifest = ucformat.convert(pipeline_cases[case] / "ckpt", tmp_path / "store")
    _check_store(tmp_path / "store", _truth(pipeline_cases[case], spec.pp, _positional(case)))
    pipeline = manifest.source.pipeline
    assert pipeline is not None
    assert pipeline.num_stages == spec.pp and pipeline.data_parallel == spec.dp
    assert manifest.source.world_size == spec.dp
    if _positional(case) and spec.tied:  # the tied module named by layer 0, on both stages
        assert [s.tied for s in pipeline.stages] == [[], []]
        assert [s.layers for s in pipeline.stages] == [[0, 1], [0, 3, 4]]
    elif spec.tied and spec.pp == 1:
        assert [s.tied for s in pipeline.stages] == [["embed"]]
        assert [s.layers for s in pipeline.stages] == [[1, 3, 4]]
    elif spec.tied and spec.pp == 4:  # uniform over 6 layers: [0-1], [2-3], [4], [5]
        assert [s.tied for s in pipeline.stages] == [["embed"], [], [], ["embed"]]
        assert [s.layers for s in pipeline.stages] == [[1], [3], [4], []]
    elif spec.tied:
        assert [s.tied for s in pipeline.stages] == [["embed"], ["embed"]]
        assert [s.layers for s in pipeline.stages] == [[1], [3, 4]]
    else:
        assert [s.tied for s in pipeline.stages] == [[], []]
        assert [s.layers for s in pipeline.stages] == [[0, 1], [3, 4, 5]]
    assert manifest.progress.global_steps == 3
    shown = summarize(manifest).header["pipeline"]
    assert shown.startswith(f"{spec.pp} stages x dp {spec.dp}; layers per stage: ")


@pytest.mark.parametrize("case", UNIVERSAL)
def test_pipeline_converts_like_ds_to_universal(
    case: str, pipeline_cases: dict[str, Path], universal: dict[str, Path], tmp_path: Path
) -> None:
    ucformat.convert(pipeline_cases[case] / "ckpt", tmp_path / "store")
    _check_store(tmp_path / "store", _universal_params(universal[case]))


def test_pipeline_names_do_not_depend_on_the_stage_count(
    pipeline_cases: dict[str, Path], tmp_path: Path
) -> None:
    names = {
        case: list(ucformat.convert(pipeline_cases[case] / "ckpt", tmp_path / case).params)
        for case in ("pp2dp1-z1-fp32-tied", "pp2dp2-z1-bf16-tied")
    }
    assert names["pp2dp1-z1-fp32-tied"] == names["pp2dp2-z1-bf16-tied"]
    assert names["pp2dp1-z1-fp32-tied"] == [
        "tied_modules.embed.weight", "1.weight", "1.bias", "3.weight", "3.bias",
        "4.weight", "4.bias",
    ]  # fmt: skip


def test_diverged_tied_copies_are_refused_naming_the_param(
    pipeline_cases: dict[str, Path], tmp_path: Path
) -> None:
    # DeepSpeed all-reduces only the tied weight's gradient across stages: the tied module's
    # bias is trained apart on the two stages, so its copies differ.
    with pytest.raises(LayoutMismatchError) as info:
        ucformat.convert(pipeline_cases["pp2dp1-z1-fp32-tiedbias"] / "ckpt", tmp_path / "s")
    assert str(info.value).startswith(
        "tied param 'tied_modules.embed.bias': its 'fp32' differs between pipeline stages 0 and 1"
    )
    assert not (tmp_path / "s" / "ucformat.json").exists()


def test_zero0_pipelines_name_the_tied_module_by_its_first_layer(
    pipeline_cases: dict[str, Path], tmp_path: Path
) -> None:
    # fp16 ZeRO-0 (FP16_UnfusedOptimizer): masters and moments by position in each stage's
    # model states, no optimizer shards; each master rounds to exactly one layer weight
    folder = pipeline_cases["pp2dp1-z0-fp16-tied"] / "ckpt" / "step3"
    assert not list(folder.glob("*optim_states.pt"))
    manifest = ucformat.convert(folder.parent, tmp_path / "s")
    assert list(manifest.params) == [
        "0.weight", "1.weight", "1.bias", "3.weight", "3.bias", "4.weight", "4.bias",
    ]  # fmt: skip
    assert manifest.source.zero_stage == 0
    assert manifest.source.optimizer_wrapper == "FP16_UnfusedOptimizer"
    scaler = manifest.progress.loss_scaler
    assert scaler is not None and scaler.class_name == "LossScaleConfig"
    assert scaler.cur_scale == 2.0**8 and scaler.attributes["cur_iter"] == 3


def test_fp16_pipeline_records_its_loss_scaler(
    pipeline_cases: dict[str, Path], tmp_path: Path
) -> None:
    manifest = ucformat.convert(pipeline_cases["pp2dp2-z1-fp16"] / "ckpt", tmp_path / "store")
    assert manifest.source.train_dtype == "float16"
    assert manifest.source.optimizer_wrapper == "DeepSpeedZeroOptimizer"
    scaler = manifest.progress.loss_scaler
    assert scaler is not None and scaler.class_name == "DynamicLossScaler"
    assert scaler.cur_scale == 2.0**8  # initial_scale_power 8, no overflow, no growth yet
    assert scaler.attributes["cur_iter"] == 3


@pytest.mark.parametrize("case", ["pp2dp2-z1-bf16-tied", "pp2dp1-z1-bf16", "pp2dp1-z1-fp16-tied"])
def test_pipeline_store_loads_into_a_plain_torch_model(
    case: str, pipeline_cases: dict[str, Path], tmp_path: Path
) -> None:
    from tests.fixtures._pp_load_worker import Plain
    from tests.fixtures.pp_cases import LR

    spec = by_name(case)
    ucformat.convert(pipeline_cases[case] / "ckpt", tmp_path / "store")
    model = Plain(spec, seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    uctorch.load(model, optimizer, tmp_path / "store")
    truth = _truth(pipeline_cases[case], spec.pp)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), truth[name]["fp32"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[param][key], truth[name][key]), (name, key)
        assert float(optimizer.state[param]["step"]) == 3.0
