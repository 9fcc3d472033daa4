"""Bad input that used to escape as a traceback or a warning: one line, exit code 2.

* ``verify --against`` a checkpoint with a parameter of the same name and another shape (with
  and without ``--json``);
* a source whose tied alias is named ``../../escape``, ``/abs/evil`` or ``a\\nb`` (the §2.4 line
  parameter and buffer names get);
* a shard index entry whose offset + length wraps 2**64: ``export`` and ``verify`` report it
  without numpy's overflow warnings on stderr.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ucformat
from tests.cli.helpers import assert_user_error, invoke
from tests.integration.test_hostile_stores import _hostile_index

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"
TIED = DATA / "z2-fp32-dsadam-ftb-ws3" / "ckpt"  # shared_params: lm_head.weight -> emb.weight


def _dcp(folder: Path, width: int) -> Path:
    """A real ``dcp.save`` of a small MLP whose hidden layer is ``width`` wide."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving as a single process"
        dcp.save({"model": model.state_dict()}, checkpoint_id=folder)
    return folder


@pytest.mark.parametrize("as_json", [False, True])
def test_verify_against_a_checkpoint_of_other_shapes(tmp_path: Path, as_json: bool) -> None:
    store = tmp_path / "s.ucf"
    ucformat.convert(_dcp(tmp_path / "a", 16), store)
    other = _dcp(tmp_path / "b", 12)
    args = ["verify", store, "--against", other, *(["--json"] if as_json else [])]
    assert_user_error(
        invoke(*args),
        f"{other}: parameter '0.weight' has shape [12, 8] there but [16, 8] in the store",
        "not converted from this checkpoint",
    )


@pytest.mark.parametrize("alias", ["../../escape", "/abs/evil", "a\nb"])
def test_a_hostile_tied_alias_name_is_one_line(tmp_path: Path, alias: str) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TIED, ckpt)
    (states,) = ckpt.glob("*/mp_rank_00_model_states.pt")
    saved = torch.load(states, weights_only=False)  # the fixture, written by DeepSpeed itself
    saved["shared_params"] = {alias: "emb.weight"}
    torch.save(saved, states)
    line = assert_user_error(
        invoke("convert", ckpt, tmp_path / "out.ucf", "-q"),
        f"tied alias name {alias!r} of parameter 'emb.weight' cannot name an array",
        "(docs/format.md §2.4)",
    )
    assert "\n" not in line
    assert not (tmp_path / "out.ucf").exists()


def test_a_wrapping_shard_index_is_reported_without_warnings(tmp_path: Path) -> None:
    store = tmp_path / "s.ucf"
    ucformat.convert(
        DATA / "z3-bf16-dsadam-ftb-ws4" / "ckpt", store, chunk_bytes=64, shard_bytes=256
    )
    _hostile_index(store)  # an index entry at offset 2**64 - 8: offset + length wraps
    cli = [sys.executable, "-m", "ucformat_cli"]
    export = [*cli, "export", "safetensors", str(store), str(tmp_path / "out"), "-q"]
    done = subprocess.run(export, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()  # no RuntimeWarning lines before it
    assert line.startswith("error: params/") and "the store is corrupt" in line, line
    done = subprocess.run([*cli, "verify", str(store)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout
    assert done.stderr == ""


def test_a_folder_of_someone_s_notes_is_never_offered_overwrite(tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):  # the advice must not be one that then refuses
        line = assert_user_error(
            invoke("convert", TIED, notes, "-q", *extra), "exists and is not a ucformat store"
        )
        assert "overwrite" not in line.replace("refusing to overwrite", ""), line
    assert [p.name for p in notes.iterdir()] == ["todo.txt"]


def test_a_folder_that_is_no_checkpoint_names_what_each_format_needs(tmp_path: Path) -> None:
    (tmp_path / "todo.txt").write_text("mine")
    assert_user_error(
        invoke("convert", tmp_path, tmp_path / "out.ucf"),
        "not a checkpoint ucformat reads",
        "DeepSpeed ZeRO (a tag folder with mp_rank_00_model_states.pt",
        "PyTorch DCP (a '.metadata' file",
        "Megatron-Core torch_dist",
        "Accelerate FSDP2 save_state (a 'pytorch_model_fsdp_0/' folder)",
        "Found: todo.txt.",
    )


def _commands(*path: str) -> str:
    """The commands of the real CLI's group at ``path``, as the error line lists them."""
    import typer.main
    from ucformat_cli.main import app

    group: Any = typer.main.get_command(app)
    for name in path:
        group = group.commands[name]
    return ", ".join(group.commands)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["conver"], "No such command 'conver'. Did you mean 'convert'? The commands are: "
         f"{_commands()}. (see 'ucformat --help')"),
        (["export", "safetensor"], "No such command 'safetensor'. Did you mean 'safetensors'? "
         f"The commands are: {_commands('export')}. (see 'ucformat export --help')"),
    ],
)  # fmt: skip
def test_a_mistyped_command_is_one_line_naming_the_commands(args: list[str], said: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ucformat", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [f"error: {said}"]
    assert "convert, inspect, verify, export" in said or "safetensors, deepspeed-universal" in said


def test_python_m_ucformat_is_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ucformat", "--version"], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout) == (0, f"ucformat {ucformat.__version__}\n")


def test_the_help_names_every_source_not_deepspeed_only() -> None:
    top = invoke("--help").stdout
    assert "DeepSpeed ZeRO, Megatron-Core, PyTorch DCP/FSDP2" in top
    against = invoke("verify", "--help").stdout
    assert "The DeepSpeed checkpoint" not in against
    assert "DeepSpeed, DCP/FSDP2, Megatron-Core" in " ".join(against.split())
