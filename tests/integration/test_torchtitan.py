"""torchtitan 0.3.0's own Trainer + CheckpointManager (CPU, gloo) -> ``ucformat convert`` with no
flags -> the store resumes in torchtitan at W=3 and loads into plain PyTorch.

Both runs train a tiny llama3 at W=2 with torchtitan's defaults (FSDP2, selective activation
checkpointing: the model's parameters are named ``layers.N._checkpoint_wrapped_module...``):

* ``fused`` (``fuse_qkv=True``, as every llama3 flavour): torchtitan's state-dict hook saves the
  weights split (``wq``/``wk``/``wv``) while the optimizer state stays under the fused ``wqkv``,
  whose rows interleave per KV head by a rule that needs ``head_dim``, which the checkpoint does
  not record: ``convert`` refuses in one line naming both layouts and ``--head-dim``; with
  ``--head-dim`` the store holds ``wqkv`` (weights and AdamW state) bit-exact against the job's
  live fused parameter.
* ``unfused`` (``fuse_qkv=False``): converts with no flags; the store holds every weight and
  AdamW state bit-exact against the job's gathered state, resumes in torchtitan's Trainer at
  W=3 through ``ucformat.torch.load`` (names matched through the checkpoint wrapper), optimizer
  included, bit-exact, then trains a step; and loads into a plain (unwrapped) torchtitan model.

Checkpoints are cached (tests/fixtures/torchtitan_cases.py, ``tests/.cache/torchtitan``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner
from ucformat_cli.main import app

import ucformat
import ucformat.torch
from tests.fixtures.torchtitan_cases import (
    RUNS,
    STEPS,
    generate_torchtitan,
    live_store,
    resume_torchtitan,
    step_dir,
    truth_path,
)

pytestmark = pytest.mark.torchtitan
pytest.importorskip("torchtitan", reason="needs the torchtitan extra (docs/torchtitan.md)")

WRAPPER = "_checkpoint_wrapped_module."
RESUME_WORLD = 3


@pytest.fixture(scope="module")
def folder() -> Path:
    return generate_torchtitan()


@pytest.fixture(scope="module")
def store(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("torchtitan") / "unfused.ucf"
    result = CliRunner().invoke(app, ["convert", str(step_dir(folder, "unfused")), str(out)])
    assert result.exit_code == 0, result.output
    return out


def _truth(folder: Path, run: str) -> dict[str, torch.Tensor]:
    truth: dict[str, torch.Tensor] = torch.load(truth_path(folder, run), weights_only=True)
    return truth


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_fused_qkv_is_refused_in_one_line(folder: Path, tmp_path: Path) -> None:
    src = step_dir(folder, "fused")
    result = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "fused.ucf")])
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    attn = "layers.0.attention.qkv_linear"
    for name in (f"{attn}.wq.weight", f"{attn}.wk.weight", f"{attn}.wv.weight"):
        assert name in message
    assert f"'{attn}.wqkv.weight'" in message and "fuse_qkv" in message
    assert "--head-dim" in message
    assert "--model-key" not in message and "Traceback" not in result.output
    assert not (tmp_path / "fused.ucf").exists()


def test_fused_qkv_converts_with_the_head_dimension(folder: Path, tmp_path: Path) -> None:
    """``--head-dim 8`` (dim 32 / 4 heads): every parameter, the fused ``wqkv`` included, and
    its AdamW state equal the job's live state bit for bit."""
    src, out = step_dir(folder, "fused"), tmp_path / "fused.ucf"
    result = CliRunner().invoke(app, ["convert", str(src), str(out), "--head-dim", "8"])
    assert result.exit_code == 0, result.output
    truth = _truth(folder, "fused")
    ckpt = ucformat.open(out)
    live = {k.removeprefix("param.").replace(WRAPPER, ""): k.removeprefix("param.")
            for k in truth if k.startswith("param.")}  # fmt: skip
    assert set(ckpt.manifest.params) == set(live)
    assert any(name.endswith("qkv_linear.wqkv.weight") for name in live)
    for name, key in live.items():
        assert _same(ckpt.read(name, "fp32"), truth[f"param.{key}"]), name
        for state in ("exp_avg", "exp_avg_sq"):
            assert _same(ckpt.read(name, state), truth[f"optim.{key}.{state}"]), (name, state)
    wrong = CliRunner().invoke(
        app, ["convert", str(src), str(tmp_path / "w.ucf"), "--head-dim", "5"]
    )
    assert wrong.exit_code == 2 and "--head-dim 5 does not fit" in " ".join(wrong.output.split())


def test_unfused_store_holds_the_gathered_state(folder: Path, store: Path) -> None:
    truth = _truth(folder, "unfused")
    ckpt = ucformat.open(store)
    manifest = ckpt.manifest
    names = {k.removeprefix("sd."): v for k, v in truth.items() if k.startswith("sd.")}
    assert set(manifest.params) == set(names)  # the model's own names, no wrapper
    assert not any(WRAPPER in n for n in manifest.params)
    assert manifest.progress.global_steps == STEPS  # torchtitan's train_state.step
    for name, value in names.items():
        assert _same(ckpt.read(name, "fp32"), value), name
        param = next(k for k in truth if k.startswith("param.") and
                     k.replace(WRAPPER, "") == f"param.{name}")  # fmt: skip
        for state in ("exp_avg", "exp_avg_sq"):
            expected = truth[f"optim.{param.removeprefix('param.')}.{state}"]
            assert _same(ckpt.read(name, state), expected), (name, state)


@pytest.fixture(scope="module")
def resumed(folder: Path, store: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("torchtitan-resume")
    dump = resume_torchtitan(store, "unfused", out, RESUME_WORLD, folder)
    return {**torch.load(dump, weights_only=True), "live": live_store(out, "unfused")}


def test_resumes_in_torchtitan_at_another_world_size_then_trains(
    folder: Path, resumed: dict[str, dict[str, torch.Tensor]]
) -> None:
    truth, loaded, after = _truth(folder, "unfused"), resumed["loaded"], resumed["after"]
    assert set(loaded) == set(truth) and any(WRAPPER in k for k in loaded)
    for key, value in truth.items():
        assert _same(loaded[key], value), key
    moved = [k for k in loaded if k.startswith("param.") and not torch.equal(after[k], loaded[k])]
    assert moved and all(torch.isfinite(after[k]).all() for k in moved)
    steps = [after[k] for k in after if k.endswith(".step")]
    assert steps and all(float(s) == STEPS + 1 for s in steps)


def test_live_save_of_the_wrapped_model_has_the_models_names(
    folder: Path, store: Path, resumed: dict[str, Any]
) -> None:
    """``ucformat.torch.save`` from torchtitan's checkpoint-wrapped FSDP2 model at W=3: the
    store has the converted store's names (no wrapper) and the state the job held."""
    live = ucformat.open(resumed["live"])
    assert set(live.manifest.params) == set(ucformat.open(store).manifest.params)
    after = resumed["after"]
    for key, value in after.items():
        if key.startswith("param."):
            name = key.removeprefix("param.").replace(WRAPPER, "")
            assert _same(live.read(name, "fp32"), value), name
            optim = f"optim.{key.removeprefix('param.')}.exp_avg"
            assert _same(live.read(name, "exp_avg"), after[optim]), name


def test_loads_into_a_plain_torchtitan_model(folder: Path, store: Path) -> None:
    from tests.fixtures._torchtitan_worker import build_model

    model = build_model(fuse_qkv=RUNS["unfused"])
    result = ucformat.torch.load(model, None, store)
    assert not result.missing and not result.unexpected
    truth = _truth(folder, "unfused")
    for name, value in model.state_dict().items():
        assert _same(value, truth[f"sd.{name}"]), name
