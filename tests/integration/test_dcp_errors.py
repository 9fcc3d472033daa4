"""Damaged, hostile and unknown DCP folders: one-line error, exit 2, a typed error, nothing written.

The folders are copies of the real FSDP2 + ``dcp.save`` fixture (tests/fixtures/dcp_cases.py),
damaged one way each, plus layouts saved here by stock ``dcp.save`` (single process).
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import ucformat
from tests.cli.helpers import assert_user_error, invoke
from tests.fixtures.dcp_cases import generate_dcp
from tests.fixtures.models import build_model
from tests.hostile import ATTACK_NAMES, attacks, replace_data_pkl
from ucformat.errors import (
    NotACheckpointError,
    SourceNotFoundError,
    TruncatedFileError,
    UnsafePickleError,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def flat_dcp() -> Path:
    return generate_dcp()["fsdp2-multi-ws2"] / "flat"


@pytest.fixture
def damaged(flat_dcp: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(flat_dcp, copy)
    return copy


def _fails(src: Path, tmp_path: Path, error: type[Exception], *fragments: str) -> None:
    """The API raises ``error``; the CLI prints one line and exits 2; nothing is written."""
    with pytest.raises(error):
        ucformat.convert(src, tmp_path / "api.ucf")
    assert not (tmp_path / "api.ucf").exists()
    assert_user_error(invoke("convert", src, tmp_path / "cli.ucf"), *fragments)
    assert not (tmp_path / "cli.ucf").exists()


def test_truncated_data_file(damaged: Path, tmp_path: Path) -> None:
    data = damaged / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    _fails(damaged, tmp_path, TruncatedFileError, "__1_0.distcp", "truncated")


def test_missing_data_file(damaged: Path, tmp_path: Path) -> None:
    (damaged / "__0_0.distcp").unlink()
    _fails(damaged, tmp_path, SourceNotFoundError, "__0_0.distcp", "missing")


@pytest.mark.parametrize("attack", ATTACK_NAMES)
def test_hostile_metadata_runs_nothing(damaged: Path, tmp_path: Path, attack: str) -> None:
    sentinel = tmp_path / "pwned"
    (damaged / ".metadata").write_bytes(pickle.dumps(attacks(sentinel)[attack]))
    _fails(damaged, tmp_path, UnsafePickleError, ".metadata", "refusing to load")
    assert not sentinel.exists()


@pytest.mark.parametrize("attack", ["os.system", "builtins.eval", "nested in a state dict"])
def test_hostile_item_in_a_data_file_runs_nothing(
    damaged: Path, tmp_path: Path, attack: str
) -> None:
    """A hyper-parameter's torch.save archive replaced by one whose data.pkl is hostile."""
    sentinel = tmp_path / "pwned"
    archive = tmp_path / "item.pt"
    torch.save(0.001, archive)
    replace_data_pkl(archive, attacks(sentinel)[attack])
    data = damaged / "__1_0.distcp"
    offset = data.stat().st_size
    data.write_bytes(data.read_bytes() + archive.read_bytes())
    metadata = FileSystemReader(str(damaged)).read_metadata()  # our own fixture: trusted
    index = next(i for i in metadata.storage_data if i.fqn.endswith(".lr"))
    info = metadata.storage_data[index]
    info.relative_path, info.offset, info.length = data.name, offset, archive.stat().st_size
    (damaged / ".metadata").write_bytes(pickle.dumps(metadata))
    _fails(damaged, tmp_path, UnsafePickleError, "__1_0.distcp", "refusing to load")
    assert not sentinel.exists()


def test_metadata_naming_a_file_outside_the_folder(damaged: Path, tmp_path: Path) -> None:
    metadata = FileSystemReader(str(damaged)).read_metadata()  # our own fixture: trusted
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = "../../etc/passwd"
    (damaged / ".metadata").write_bytes(pickle.dumps(metadata))
    _fails(damaged, tmp_path, NotACheckpointError, "not a plain file name")


def _save_plain(folder: Path, layout: str) -> None:
    model, _ = build_model("simple")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if layout == "weights":
        dcp_save({"weights": state}, checkpoint_id=folder)
    else:  # an optimizer keyed by parameter index (optimizer.state_dict())
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(1, 10)).sum().backward()
        optimizer.step()
        dcp_save({"model": state, "optimizer": optimizer.state_dict()}, checkpoint_id=folder)


def test_unknown_layout_names_the_keys_and_options(tmp_path: Path) -> None:
    folder = tmp_path / "weights"
    _save_plain(folder, "weights")
    _fails(folder, tmp_path, NotACheckpointError, "keys found: weights", "--model-key")
    manifest = ucformat.convert(folder, tmp_path / "ok.ucf", model_key="weights")
    model, _ = build_model("simple")
    assert set(manifest.params) == set(dict(model.named_parameters()))
    assert manifest.optimizer is None
    want = model.state_dict()["fc1.weight"]
    assert torch.equal(ucformat.open(tmp_path / "ok.ucf").read("fc1.weight", "fp32"), want)


def test_optimizer_keyed_by_index_is_refused_with_advice(tmp_path: Path) -> None:
    folder = tmp_path / "indexed"
    _save_plain(folder, "indexed")
    _fails(folder, tmp_path, NotACheckpointError, "get_optimizer_state_dict")


def test_model_key_on_a_deepspeed_source_is_refused(tmp_path: Path) -> None:
    src = Path(__file__).parents[1] / "fixtures" / "data" / "z1-bf16-dsadam-simple-ws2" / "ckpt"
    result = invoke("convert", src, tmp_path / "x.ucf", "--model-key", "model")
    assert_user_error(result, "--model-key")


def test_convert_releases_every_file_descriptor(flat_dcp: Path, tmp_path: Path) -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    ucformat.convert(flat_dcp, tmp_path / "warm.ucf")  # zarr's event loop keeps its own fds
    before = open_fds()
    ucformat.convert(flat_dcp, tmp_path / "ok.ucf")
    with pytest.raises(NotACheckpointError):
        ucformat.convert(flat_dcp, tmp_path / "bad.ucf", model_key="nothing")
    assert open_fds() == before
