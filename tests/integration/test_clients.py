"""Real training clients on CPU: each saves with its own API at W=2, ``ucformat convert`` takes
the folder with no flags, and the store resumes in the same client at W=1 with every parameter
and Adam state bit-exact against the source job's gathered state, then trains on.

The client saves are cached (tests/fixtures/clients_cases.py, ``tests/.cache/clients``); the
resumes run in one torchrun launch per client. Recipes: docs/clients.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner
from ucformat_cli.main import app

import ucformat
from tests.fixtures.clients_cases import available, generate_clients, run_client_jobs
from tests.fixtures.pretrained_cases import LOADS, generate_pretrained, pretrained_jobs
from tests.fixtures.pretrained_cases import available as transformers_available

pytestmark = pytest.mark.clients


def _cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def sources() -> dict[str, Path]:
    return generate_clients()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, Path]) -> dict[str, Any]:
    """Convert every client folder with no flags, export where needed, resume them all."""
    root = tmp_path_factory.mktemp("clients")
    jobs: list[dict[str, Any]] = []
    if "lightning" in sources:
        _cli("convert", str(sources["lightning"] / "ckpt"), str(root / "lightning.ucf"))
        jobs.append({"name": "lightning-resume-w1", "client": "lightning", "kind": "resume",
                     "world_size": 1, "dir": str(root), "store": str(root / "lightning.ucf"),
                     "truth": str(sources["lightning"] / "truth.pt")})  # fmt: skip
    if "accelerate" in sources:
        saved = sources["accelerate"] / "checkpoint_0"
        _cli("convert", str(saved), str(root / "accelerate.ucf"))
        resumed = root / "checkpoint_0"  # the user's folder, RNG files included, minus the model
        shutil.copytree(saved, resumed)
        for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
            shutil.rmtree(resumed / sub)
        _cli("export", "accelerate", str(root / "accelerate.ucf"), str(resumed),
             "--world-size", "1")  # fmt: skip
        jobs.append({"name": "accelerate-resume-w1", "client": "accelerate", "kind": "resume",
                     "world_size": 1, "dir": str(root), "folder": str(resumed),
                     "truth": str(sources["accelerate"] / "truth.pt")})  # fmt: skip
    if transformers_available():  # Hugging Face weights into FSDP2, ZeRO-3, TP models
        folders = generate_pretrained()
        stores = {which: root / f"pretrained-{which}.ucf" for which in folders}
        for which, folder in folders.items():
            _cli("convert", str(folder), str(stores[which]))
        jobs.extend(pretrained_jobs(folders, stores))
    return {"root": root, "results": run_client_jobs(jobs, root / "run") if jobs else {}}


@pytest.mark.skipif(not available("lightning"), reason="lightning is not installed")
def test_lightning_model_parallel_converts_with_no_flags_and_resumes_at_w1(
    sources: dict[str, Path], work: dict[str, Any]
) -> None:
    manifest = ucformat.open(work["root"] / "lightning.ucf").manifest
    assert manifest.optimizer is not None and manifest.source.world_size == 2
    assert "model.a.weight" in manifest.params
    assert work["results"]["lightning-resume-w1"]["failures"] == []


@pytest.mark.skipif(not available("accelerate"), reason="accelerate is not installed")
def test_accelerate_fsdp2_save_state_converts_and_load_state_resumes_at_w1(
    sources: dict[str, Path], work: dict[str, Any]
) -> None:
    saved = sources["accelerate"] / "checkpoint_0"
    manifest = ucformat.open(work["root"] / "accelerate.ucf").manifest
    assert manifest.optimizer is not None and manifest.source.world_size == 2
    assert sorted(manifest.params) == sorted(manifest.optimizer.groups[0].params)
    resumed = work["root"] / "checkpoint_0"
    for rng in sorted(saved.glob("random_states_*.pkl")):  # left as the user had them
        assert (resumed / rng.name).read_bytes() == rng.read_bytes()
    assert work["results"]["accelerate-resume-w1"]["failures"] == []
    # the exported folder converts back to the same state
    _cli("convert", str(resumed), str(work["root"] / "back.ucf"))
    back = ucformat.open(work["root"] / "back.ucf")
    first = ucformat.open(work["root"] / "accelerate.ucf")
    for name in manifest.params:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            assert back.read(name, state).equal(first.read(name, state)), (name, state)


@pytest.mark.skipif(not transformers_available(), reason="transformers is not installed")
@pytest.mark.parametrize(("layout", "world_size", "dtype", "which"), LOADS)
def test_hugging_face_weights_load_into_sharded_models_as_from_pretrained_does(
    work: dict[str, Any], layout: str, world_size: int, dtype: str, which: str
) -> None:
    """Every gathered weight and the logits of a fixed batch bit-equal to ``from_pretrained``
    sharded the same way; every rank fetched at most 1.2x the bytes it needed."""
    result = work["results"][f"pretrained-{layout}-ws{world_size}-{dtype}"]
    assert result["failures"] == []
    assert len(result["amplification"]) == world_size
    assert all(1.0 <= a <= 1.2 for a in result["amplification"]), result["amplification"]


def test_unknown_dcp_layout_names_keys_and_the_layouts_it_resembles(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from ucformat.errors import NotACheckpointError

    dcp.save({"weights": {"w": torch.ones(2)}, "optimizer_0": {"lr": 1.0}},
             checkpoint_id=str(tmp_path / "d"))  # fmt: skip
    with pytest.raises(NotACheckpointError) as info:
        ucformat.convert(tmp_path / "d", tmp_path / "s")
    message = str(info.value)
    assert "\n" not in message and "top-level keys found: optimizer_0, weights" in message
    assert "Lightning ModelParallelStrategy" in message and "--model-key" in message


def test_split_weights_with_fused_optimizer_state_are_refused_in_one_line(tmp_path: Path) -> None:
    """torchtitan's fuse_qkv hook saves wq/wk/wv while the optimizer state stays under wqkv:
    the refusal names both layouts and what to do, never --model-key."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ucformat.errors import UnsupportedCheckpointError

    attn = "layers.0.attention"
    state = {f"{attn}.{m}.weight": torch.ones(4, 8) for m in ("wq", "wk", "wv", "wo")}
    state["optimizer"] = {
        "state": {f"{attn}.{m}.weight": {"exp_avg": torch.ones(n, 8), "step": torch.tensor(1.0)}
                  for m, n in (("wqkv", 12), ("wo", 4))},
        "param_groups": {f"{attn}.{m}.weight": {"lr": 0.1} for m in ("wqkv", "wo")},
    }  # fmt: skip
    dcp.save(state, checkpoint_id=str(tmp_path / "step-3"))
    with pytest.raises(UnsupportedCheckpointError) as info:
        ucformat.convert(tmp_path / "step-3", tmp_path / "s")
    message = str(info.value)
    assert "\n" not in message and "--model-key" not in message
    assert f"{attn}.wq.weight, {attn}.wk.weight, {attn}.wv.weight" in message
    assert f"fused '{attn}.wqkv.weight'" in message


def test_accelerate_folder_of_two_models_converts_model_by_model(tmp_path: Path) -> None:
    """``save_state`` of two prepared models (folders ``_0``, ``_1``, as Accelerate names them,
    written with stock dcp.save): the folder is refused in one line; ``pytorch_model_fsdp_1/``
    converts with its ``optimizer_1/``, and ``export accelerate --index 1`` writes that pair."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from tests.fixtures.models import build_model
    from ucformat.errors import UnsupportedCheckpointError

    root = tmp_path / "checkpoint_0"
    models = {}
    for index, name in enumerate(("simple", "multi")):
        model, groups = build_model(name, seed=index)
        opt = torch.optim.AdamW(groups, lr=0.01)
        inputs = torch.randn(2, model.in_features)
        model(inputs).sum().backward()
        opt.step()
        dcp.save({"model": get_model_state_dict(model)},
                 checkpoint_id=str(root / f"pytorch_model_fsdp_{index}"))  # fmt: skip
        dcp.save({"optimizer": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=str(root / f"optimizer_{index}"))  # fmt: skip
        models[index] = (model, opt)
    with pytest.raises(UnsupportedCheckpointError) as info:
        ucformat.convert(root, tmp_path / "all.ucf")
    assert "\n" not in str(info.value) and "pytorch_model_fsdp_I" in str(info.value)

    _cli("convert", str(root / "pytorch_model_fsdp_1"), str(tmp_path / "m1.ucf"))
    store = ucformat.open(tmp_path / "m1.ucf")
    model, opt = models[1]
    for name, param in model.named_parameters():
        assert store.read(name, "fp32").equal(param.detach())
        assert store.read(name, "exp_avg").equal(opt.state[param]["exp_avg"])
    _cli("export", "accelerate", str(tmp_path / "m1.ucf"), str(tmp_path / "out"), "--index", "1")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "optimizer_1", "pytorch_model_fsdp_1"]  # fmt: skip
    _cli("convert", str(tmp_path / "out" / "pytorch_model_fsdp_1"), str(tmp_path / "back.ucf"))
    back = ucformat.open(tmp_path / "back.ucf")
    for name in store.manifest.params:
        assert back.read(name, "exp_avg_sq").equal(store.read(name, "exp_avg_sq"))
