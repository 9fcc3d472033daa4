"""Hugging Face weights in: ``ucformat convert`` of what ``save_pretrained`` wrote (one file, and
sharded with an index) gives a weights-only store holding every tensor bit for bit; damaged or
inconsistent folders are refused in one line. The loads into FSDP2, ZeRO-3 and TP models run in
the clients launches (test_clients.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner
from ucformat_cli.main import app

import ucformat
import ucformat.torch as uctorch
from tests.fixtures.pretrained_cases import generate_pretrained
from ucformat.errors import NotACheckpointError, SourceNotFoundError, UnsupportedCheckpointError


@pytest.fixture(scope="module")
def folders() -> dict[str, Path]:
    return generate_pretrained()


@pytest.fixture(scope="module")
def stores(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for which, folder in folders.items():
        result = CliRunner().invoke(app, ["convert", str(folder), str(root / f"{which}.ucf")])
        assert result.exit_code == 0, result.output
        assert "from Hugging Face safetensors bfloat16" in result.output
        out[which] = root / f"{which}.ucf"
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_single_and_sharded_saves_convert_to_weights_only_stores(
    folders: dict[str, Path], stores: dict[str, Path]
) -> None:
    assert len(list(folders["sharded"].glob("*.safetensors"))) > 1
    assert (folders["sharded"] / "model.safetensors.index.json").is_file()
    expected = _tensors(folders["single"])
    for which, store_path in stores.items():
        store = ucformat.open(store_path)
        manifest = store.manifest
        assert manifest.optimizer is None and manifest.progress.global_steps == 0
        assert manifest.source.checkpoint_format == "safetensors"
        assert sorted(manifest.params) == sorted(expected)  # Hugging Face names as they are
        config = json.loads((folders[which] / "config.json").read_text())
        assert manifest.client_state.values["config.json"] == config
        files = {f.name for f in manifest.source.files}
        assert (
            "config.json" in files
            and {p.name for p in folders[which].glob("*.safetensors")} <= files
        )
        for name, value in expected.items():
            entry = manifest.params[name]
            assert entry.dtype == "bfloat16" and list(entry.states) == ["value"]
            got = store.read(name, "fp32")  # the value, upcast losslessly
            assert got.dtype == torch.float32 and torch.equal(got.to(torch.bfloat16), value), name
        result = CliRunner().invoke(
            app, ["verify", str(store_path), "--against", str(folders[which])]
        )
        assert result.exit_code == 0 and result.output.startswith("ok: "), result.output


def test_a_plain_model_loads_the_store_in_its_own_dtype(
    folders: dict[str, Path], stores: dict[str, Path]
) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folders["single"], dtype=torch.float32)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(reference.config, dtype=torch.float32)
    report = uctorch.load(model, None, stores["sharded"])
    assert report.missing == [] and report.unexpected == []
    for name, param in reference.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], param), name


def _copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(folder, out)
    return out


def _refused(src: Path, kind: type[Exception], tmp_path: Path) -> str:
    with pytest.raises(kind) as info:
        ucformat.convert(src, tmp_path / "out.ucf")
    message = str(info.value)
    assert "\n" not in message and not (tmp_path / "out.ucf").exists()
    return message


def test_inconsistent_sharded_folders_are_refused_in_one_line(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    model = _copy(folders["sharded"], tmp_path)
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, first = next(iter(index["weight_map"].items()))

    def with_map(weight_map: dict[str, str]) -> None:
        index_path.write_text(json.dumps({**index, "weight_map": weight_map}))

    with_map({**index["weight_map"], name: "../outside.safetensors"})
    assert "not a plain file name" in _refused(model, NotACheckpointError, tmp_path)
    with_map({**index["weight_map"], name: "model-99.safetensors"})
    assert "model-99.safetensors: missing" in _refused(model, SourceNotFoundError, tmp_path)
    other = next(f for f in index["weight_map"].values() if f != first)
    with_map({**index["weight_map"], name: other})
    assert f"lists tensor '{name}' in {other}, but it is in {first}" in _refused(
        model, NotACheckpointError, tmp_path
    )
    with_map({k: v for k, v in index["weight_map"].items() if k != name})
    assert f"does not list tensor '{name}'" in _refused(model, NotACheckpointError, tmp_path)
    with_map(index["weight_map"])
    (model / other).write_bytes((model / other).read_bytes()[:-3])
    assert "truncated" in _refused(model, Exception, tmp_path)


def test_single_files_folders_and_options(folders: dict[str, Path], tmp_path: Path) -> None:
    one = tmp_path / "weights.safetensors"
    save_file({"w": torch.arange(6, dtype=torch.float16).reshape(2, 3),
               "bn.running_mean": torch.ones(3), "ids": torch.arange(4)}, one)  # fmt: skip
    manifest = ucformat.convert(one, tmp_path / "one.ucf")
    assert list(manifest.params) == ["w"] and sorted(manifest.buffers) == ["bn.running_mean", "ids"]
    assert ucformat.open(tmp_path / "one.ucf").read("ids", "buffer").equal(torch.arange(4))
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(one, two / "a.safetensors")
    shutil.copy(one, two / "b.safetensors")
    assert "holds 2 .safetensors files" in _refused(two, NotACheckpointError, tmp_path)
    with pytest.raises(UnsupportedCheckpointError, match="--model-key"):
        ucformat.convert(folders["single"], tmp_path / "k.ucf", model_key="model")
