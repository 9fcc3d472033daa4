"""torch_checkpointing in: checkpoints written by torch_checkpointing 0.1.1 itself (an FSDP2 run at
W=2, tests/fixtures/_tc_jobs.py, cached with the clients' saves) convert like DCP folders with no
flags, and load back exact; ``metadata.pkl`` and the item files are read without running any
pickled code."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner
from ucformat_cli.main import app

import ucformat
import ucformat.torch as uctorch
from tests.fixtures.clients_cases import available, generate_clients
from tests.fixtures.models import build_model
from tests.hostile import attacks, replace_data_pkl
from ucformat.errors import UnsafePickleError, UnsupportedCheckpointError

pytestmark = [
    pytest.mark.clients,
    pytest.mark.skipif(not available("torch_checkpointing"), reason="no torch_checkpointing"),
]

NAMES = ("tc-titan", "tc-nested")


@pytest.fixture(scope="module")
def saved() -> Path:
    return generate_clients()["torch_checkpointing"]


@pytest.fixture(scope="module")
def stores(saved: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tc")
    out = {}
    for name in NAMES:
        result = CliRunner().invoke(app, ["convert", str(saved / name), str(root / f"{name}.ucf")])
        assert result.exit_code == 0, result.output
        assert "from torch_checkpointing x2 float32" in result.output
        out[name] = root / f"{name}.ucf"
    return out


def _truth(saved: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(saved / "truth.pt", weights_only=True)
    return state


@pytest.mark.parametrize("name", NAMES)
def test_checkpoints_written_by_the_library_convert_exactly(
    saved: Path, stores: dict[str, Path], name: str
) -> None:
    """Flattened (torchtitan's layout) and nested optimizer state, the model as torch or
    safetensors files: every weight, Adam state and step bit-equal to the saving run's gathered
    state; both param groups; torchtitan's train_state.step as the progress."""
    truth = _truth(saved)
    store = ucformat.open(stores[name])
    manifest = store.manifest
    assert manifest.source.checkpoint_format == "torch-checkpointing"
    assert manifest.source.world_size == 2 and manifest.source.mesh_shape == [2]
    assert manifest.progress.global_steps == 3
    assert manifest.client_state.values["train_state.ntokens_seen"] == 96
    assert "lr_scheduler.last_epoch" in manifest.client_state.values
    assert manifest.optimizer is not None and len(manifest.optimizer.groups) == 2
    assert sorted(manifest.params) == sorted(truth["params"])
    for param, value in truth["params"].items():
        assert torch.equal(store.read(param, "fp32"), value), param
        for key, state in truth["states"][param].items():
            assert torch.equal(torch.as_tensor(store.read(param, key)), state), (param, key)
    lrs = sorted(g.hyperparams["lr"] for g in manifest.optimizer.groups)
    assert lrs == sorted(truth["lr"])
    result = CliRunner().invoke(app, ["verify", str(stores[name]), "--against", str(saved / name)])
    assert result.exit_code == 0 and result.output.startswith("ok: "), result.output


def test_a_converted_checkpoint_loads_back_into_a_model_and_optimizer(
    saved: Path, stores: dict[str, Path]
) -> None:
    truth = _truth(saved)
    model, groups = build_model("multi", seed=123)
    optimizer = torch.optim.AdamW(groups)
    uctorch.load(model, optimizer, stores["tc-titan"])
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), truth["params"][name]), name
        for key, value in truth["states"][name].items():
            assert torch.equal(optimizer.state[param][key], value), (name, key)
    assert sorted(g["lr"] for g in optimizer.param_groups) == sorted(truth["lr"])


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "ckpt"
    shutil.copytree(saved / "tc-titan", out)
    return out


def test_hostile_metadata_and_item_files_are_refused_and_nothing_runs(
    saved: Path, tmp_path: Path
) -> None:
    """``metadata.pkl`` admits no global at all; an item file's pickle goes through the
    allow-list: a code-running payload in either is refused, the sentinel never appears."""
    sentinel = tmp_path / "ran"
    payload = attacks(sentinel)["os.system"]
    folder = _copy(saved, tmp_path)
    metadata = pickle.loads((folder / "metadata.pkl").read_bytes())  # the fixture: trusted
    (folder / "metadata.pkl").write_bytes(pickle.dumps({**metadata, "world_size": payload}))
    with pytest.raises(UnsafePickleError, match="system"):
        ucformat.convert(folder, tmp_path / "out.ucf")
    (folder / "metadata.pkl").write_bytes(pickle.dumps({**metadata, "version": "1.0"}))
    with pytest.raises(UnsupportedCheckpointError, match=r"metadata version 1\.0"):
        ucformat.convert(folder, tmp_path / "out.ucf")
    (folder / "metadata.pkl").write_bytes(pickle.dumps(metadata))
    replace_data_pkl(folder / "model_1.pt", {"a.weight": payload})
    with pytest.raises(UnsafePickleError, match="system"):
        ucformat.convert(folder, tmp_path / "out.ucf")
    assert not sentinel.exists() and not (tmp_path / "out.ucf").exists()
