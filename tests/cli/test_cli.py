"""The ``ucformat`` command line: happy paths, and every bad input a user can produce.

A bad input must give exit code 2 and exactly one line on stderr starting with ``error:``, and
write or modify nothing. ``verify`` exits 1 when it finds problems, each on its own line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import zarr
from zarr.storage import LocalStore

import ucformat
from tests.cli.helpers import assert_user_error, heavy_imports, invoke
from tests.helpers import chunk_in_object, shard_key
from tests.hostile import (
    ATTACK_NAMES,
    EXPECTED_GLOBAL,
    EXPECTED_GLOBAL_PLAIN_PICKLE,
    attacks,
    replace_data_pkl,
)
from ucformat.format.schema import SCHEMA_PATH
from ucformat.store.manifest_io import load_manifest

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"
ZERO2 = DATA / "z2-fp32-dsadam-ftb-ws3" / "ckpt"  # world size 3
ZERO1 = DATA / "z1-bf16-dsadam-simple-ws2" / "ckpt"  # world size 2, bf16_ optimizer shards
STEP = "global_step4"


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` (or ``root`` itself) with its size and mtime."""
    if not root.exists():
        return {}
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in files}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "ckpt.ucf"
    result = invoke("convert", ZERO2, path, "--chunk-kib", "1")
    assert result.exit_code == 0, result.stderr
    return path


def copy_store(store: Path, tmp_path: Path) -> Path:
    path = tmp_path / "copy.ucf"
    shutil.copytree(store, path)
    return path


# --- happy paths ------------------------------------------------------------------------------
def test_convert_prints_one_summary_line(tmp_path: Path) -> None:
    result = invoke("convert", ZERO2, tmp_path / "out.ucf", "--tag", STEP)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("wrote 20 arrays (") and result.stdout.count("\n") == 1
    assert "DeepSpeed ZeRO-2 x3 float32 (tag global_step4)" in result.stdout
    assert result.stderr == ""
    assert ucformat.verify(tmp_path / "out.ucf", against=ZERO2).ok


def test_convert_dry_run_writes_nothing(tmp_path: Path) -> None:
    result = invoke("convert", ZERO2, tmp_path / "out.ucf", "--dry-run")
    assert result.exit_code == 0 and result.stdout.startswith("would write 20 arrays")
    assert not (tmp_path / "out.ucf").exists()


def test_convert_overwrite_replaces_a_store(store: Path, tmp_path: Path) -> None:
    path = copy_store(store, tmp_path)
    result = invoke("convert", ZERO1, path, "--overwrite")
    assert result.exit_code == 0, result.stderr
    assert ucformat.open(path).manifest.source.world_size == 2
    assert ucformat.verify(path, against=ZERO1).ok


def test_inspect_shows_the_checkpoint(store: Path) -> None:
    result = invoke("inspect", store)
    assert result.exit_code == 0, result.stderr
    assert "DeepSpeed 0.19.8, ZeRO-2, world size 3, float32" in result.stdout
    assert "params: 7 (293 elements), 1 tied aliases, 3 buffers" in result.stdout


def test_inspect_json_is_the_manifest_and_matches_the_schema(store: Path) -> None:
    result = invoke("inspect", store, "--json")
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    jsonschema.validate(document, json.loads(SCHEMA_PATH.read_text()))
    assert document == ucformat.open(store).manifest.model_dump(mode="json")


@pytest.mark.parametrize("extra", [[], ["--json"], ["--param", "emb.*"]])
def test_inspect_reads_only_the_manifest(
    store: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]
) -> None:
    opened: list[str] = []
    original_read_bytes = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        opened.append(self.relative_to(store).as_posix())
        return original_read_bytes(self)

    async def get(self: LocalStore, key: str, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"inspect went through zarr for {key}")

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    monkeypatch.setattr(LocalStore, "get", get)
    result = invoke("inspect", store, *extra)
    assert result.exit_code == 0, result.stderr
    assert opened == ["ucformat.json"]


def test_inspect_of_a_store_url_reads_only_the_manifest(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = zarr.storage.MemoryStore()
    for path in sorted(p for p in store.rglob("*") if p.is_file()):
        key = path.relative_to(store).as_posix()
        zarr.core.sync.sync(
            memory.set(key, zarr.core.buffer.default_buffer_prototype().buffer.from_bytes(
                path.read_bytes()
            ))
        )  # fmt: skip
    keys: list[str] = []
    original_get = zarr.storage.MemoryStore.get

    async def get(self: Any, key: str, *args: Any, **kwargs: Any) -> Any:
        keys.append(key)
        return await original_get(self, key, *args, **kwargs)

    monkeypatch.setattr(zarr.storage.MemoryStore, "get", get)
    manifest = load_manifest(memory)
    assert keys == ["ucformat.json"]
    assert manifest == ucformat.open(store).manifest


@pytest.mark.parametrize("source", [ZERO1, ZERO2], ids=["zero1-bf16", "zero2-fp32"])
def test_convert_does_not_import_torch(source: Path, tmp_path: Path) -> None:
    """Conversion reads torch files with its own reader: no torch start-up, no torch memory."""
    out = tmp_path / "out.ucf"
    _, imported = heavy_imports("convert", source, out, "-q", watch=("torch", "deepspeed"))
    assert imported == []
    assert ucformat.verify(out, against=source).ok


def test_inspect_imports_neither_torch_nor_zarr(store: Path) -> None:
    """What keeps ``ucformat inspect`` instant: it never imports torch, zarr or DeepSpeed."""
    stdout, imported = heavy_imports("inspect", store, watch=("torch", "zarr", "deepspeed"))
    assert "params: 7 (293 elements)" in stdout
    assert imported == []


def test_verify_ok(store: Path) -> None:
    result = invoke("verify", store)
    assert result.exit_code == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    shards = _shard_count(store)
    assert len(lines) == 1 and lines[0].startswith(f"ok: {store}: 20 arrays, {shards} shards, ")
    assert result.stderr == ""


def test_verify_against_the_source(store: Path) -> None:
    result = invoke("verify", store, "--against", ZERO2)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert f"compared with {ZERO2}" in result.stdout


def test_verify_json(store: Path) -> None:
    result = invoke("verify", store, "--json", "--against", ZERO2)
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["problems"] == []
    assert report["arrays"] == 20 and report["chunks"] >= 20
    assert report["source_bytes"] == report["nbytes"] > 0


# --- verify finds problems: exit 1, each problem on its own line --------------------------------
def _flip_byte(path: Path, position: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0xFF
    path.write_bytes(bytes(data))


def _shard_count(store: Path) -> int:
    """Shard objects of a store (format 3.1: of its stacks)."""
    return sum(1 for p in store.rglob("c.*") if p.is_file())


def test_verify_names_each_bad_chunk_and_exits_1(store: Path, tmp_path: Path) -> None:
    path = copy_store(store, tmp_path)
    manifest = ucformat.open(store).manifest
    exp_avg = manifest.params["emb.weight"].states["exp_avg"]
    bias = manifest.params["up.bias"].states["fp32"]
    assert exp_avg.stack is not None and bias.stack is not None
    _flip_byte(*chunk_in_object(path, exp_avg, (0, 0)))
    (path / shard_key(bias, (0,))).unlink()
    result = invoke("verify", path)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    first = exp_avg.stack.index * 16 * 8  # emb.weight is (16, 8), its first chunk 128 elements
    assert lines[0] == (
        f"{exp_avg.path}: chunk ({exp_avg.stack.index}, 0, 0) (elements [{first}, "
        f"{first + 128})) of params/emb.weight/exp_avg fails its crc32c checksum"
    )
    missing = f"{bias.path}: shard object '{shard_key(bias, (0,))}' is missing: "
    assert lines[1].startswith(missing) and "params/up.bias/fp32" in lines[1]
    assert lines[2].startswith(f"FAILED: {path}: 2 problem(s); 20 arrays, ")
    report = json.loads(invoke("verify", path, "--json").stdout)
    per_shard = bias.stack.per_shard
    assert [(p["kind"], p["path"], p["chunk"]) for p in report["problems"]] == [
        ("checksum", exp_avg.path, [exp_avg.stack.index, 0, 0]),
        ("missing", bias.path, [bias.stack.index // per_shard, 0]),
    ]


def test_verify_against_another_checkpoint_fails(store: Path) -> None:
    result = invoke("verify", store, "--against", DATA / "z3-bf16-dsadam-ftb-ws4" / "ckpt")
    assert result.exit_code == 1
    assert "ucformat.json: 'source.zero_stage' is 2 in the store, 3 in the source" in result.stdout


def test_verify_reports_an_unparsable_manifest(store: Path, tmp_path: Path) -> None:
    path = copy_store(store, tmp_path)
    (path / "ucformat.json").write_text("{")
    result = invoke("verify", path)
    assert result.exit_code == 1
    assert result.stdout.startswith("ucformat.json: not valid JSON")
    assert_user_error(invoke("inspect", path), "ucformat.json: not valid JSON")


# --- bad inputs for convert: exit 2, one line, nothing written ---------------------------------
def _copy_source(tmp_path: Path, source: Path = ZERO2) -> Path:
    target = tmp_path / "src"
    shutil.copytree(source, target)
    return target


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _not_deepspeed(tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    folder.mkdir()
    torch.save({"weights": torch.randn(4), "epoch": 3}, folder / "mp_rank_00_model_states.pt")
    return folder


def _mixed_runs(tmp_path: Path) -> Path:
    src = _copy_source(tmp_path)
    name = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(ZERO1 / STEP / name, src / STEP / name.removeprefix("bf16_"))
    return src


def _mixed_prefixes(tmp_path: Path) -> Path:
    src = _copy_source(tmp_path)
    name = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(ZERO1 / STEP / name, src / STEP / name)
    return src


def _delete(name: str) -> Callable[[Path], Path]:
    def build(tmp_path: Path) -> Path:
        src = _copy_source(tmp_path)
        (src / STEP / name).unlink()
        return src

    return build


def _truncated(name: str) -> Callable[[Path], Path]:
    def build(tmp_path: Path) -> Path:
        src = _copy_source(tmp_path)
        _truncate(src / STEP / name)
        return src

    return build


def _latest_names(tag: str) -> Callable[[Path], Path]:
    def build(tmp_path: Path) -> Path:
        src = _copy_source(tmp_path)
        (src / "latest").write_text(tag)
        return src

    return build


def _edited(name: str, edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], Path]:
    """A real shard file, loaded by torch (trusted: our own fixture), edited and saved back."""

    def build(tmp_path: Path) -> Path:
        pytest.importorskip("deepspeed")  # the shards pickle DeepSpeed classes
        src = _copy_source(tmp_path)
        for path in (src / STEP).glob(name):
            state = torch.load(path, weights_only=False)
            edit(state)
            torch.save(state, path)
        return src

    return build


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"not a folder")
    return path


def _empty(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir()
    return tmp_path / "src"


OPTIM1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
BAD_SOURCES: dict[str, tuple[Callable[[Path], Path], list[str], list[str]]] = {
    "missing folder": (lambda t: t / "nope", [], ["nope: no such file or directory"]),
    "empty folder": (
        _empty,
        [],
        ["not a checkpoint ucformat reads", "_model_states.pt", "'.metadata'", "save_state"],
    ),
    "a file, not a folder": (_file, [], ["ckpt.pt: is a file"]),
    "not a DeepSpeed .pt": (_not_deepspeed, [], ["not a DeepSpeed ZeRO model-states file"]),
    "missing rank file": (_delete(OPTIM1), [], [f"{OPTIM1}: missing", "every rank 0..2"]),
    "missing last rank file": (
        _delete("zero_pp_rank_2_mp_rank_00_optim_states.pt"),
        [],
        ["dp_world_size is 3 but the folder has 2 optimizer shards"],
    ),
    "missing model file": (
        _delete("mp_rank_00_model_states.pt"),
        [],
        ["no DeepSpeed model-states"],
    ),
    "truncated rank file": (_truncated(OPTIM1), [], [f"{OPTIM1}: not a complete zip archive"]),
    "truncated model file": (
        _truncated("mp_rank_00_model_states.pt"),
        [],
        ["mp_rank_00_model_states.pt: not a complete zip archive"],
    ),
    "mixed world sizes": (_mixed_runs, [], ["partition_count of group 0 is 2", "mixed"]),
    "mixed shard prefixes": (_mixed_prefixes, [], ["two optimizer shards for rank 1", "mixed"]),
    "damaged structure": (
        _edited("mp_rank_00_model_states.pt", lambda state: state.update(param_shapes=7)),
        [],
        ["unexpected content in the shard files (TypeError:", "damaged or not written by"],
    ),
    "non-finite value": (
        _edited(
            "zero_pp_rank_*_optim_states.pt",
            lambda state: state["optimizer_state_dict"].update(clip_grad=float("inf")),
        ),
        [],
        ["TrainingProgress.clip_grad = inf cannot be stored in the manifest"],
    ),
    "wrong tag": (lambda t: ZERO2, ["--tag", "global_step9"], ["no tag folder 'global_step9'"]),
    "latest names no tag": (_latest_names("global_step8"), [], ["names tag 'global_step8'"]),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_bad_source_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, case: str) -> None:
    build, extra, fragments = BAD_SOURCES[case]
    src = build(tmp_path)
    before = snapshot(src)
    dst = tmp_path / "out.ucf"
    assert_user_error(invoke("convert", src, dst, *extra), *fragments)
    assert not dst.exists()
    assert snapshot(src) == before


@pytest.mark.parametrize("target", ["model", "optim"])
@pytest.mark.parametrize("attack", ATTACK_NAMES)
def test_hostile_shard_is_refused_and_nothing_runs(
    tmp_path: Path, attack: str, target: str
) -> None:
    sentinel = tmp_path / "PWNED"
    src = _copy_source(tmp_path)
    payload = attacks(sentinel)[attack]
    if target == "model":  # a torch.save of a hostile object, under the model file's name
        victim = src / STEP / "mp_rank_00_model_states.pt"
        torch.save({"module": payload, "dp_world_size": 3}, victim)
        expected = EXPECTED_GLOBAL[attack]
    else:  # a real optimizer shard whose data.pkl alone is replaced
        victim = src / STEP / OPTIM1
        replace_data_pkl(victim, {"optimizer_state_dict": payload})
        expected = EXPECTED_GLOBAL_PLAIN_PICKLE[attack]
    dst = tmp_path / "out.ucf"
    line = assert_user_error(
        invoke("convert", src, dst),
        f"{victim}: refusing to load",
        f"{expected}', which is not on ucformat's allow-list",
        "nothing was executed",
    )
    assert "--opaque-global" in line
    assert not sentinel.exists()
    assert not dst.exists()


def test_hostile_shard_is_refused_by_verify_against(store: Path, tmp_path: Path) -> None:
    sentinel = tmp_path / "PWNED"
    src = _copy_source(tmp_path)
    replace_data_pkl(src / STEP / OPTIM1, attacks(sentinel)["os.system"])
    assert_user_error(invoke("verify", store, "--against", src), "refusing to load")
    assert not sentinel.exists()


def test_existing_destination_is_not_touched(store: Path) -> None:
    before = snapshot(store)
    assert_user_error(
        invoke("convert", ZERO2, store), "already exists and is not empty; pass --overwrite"
    )
    assert snapshot(store) == before


def test_overwrite_refuses_a_folder_that_is_not_a_store(tmp_path: Path) -> None:
    folder = tmp_path / "precious"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    before = snapshot(folder)
    assert_user_error(
        invoke("convert", ZERO2, folder, "--overwrite"),
        "is not a ucformat store (no zarr.json or ucformat.json); refusing",
    )
    assert snapshot(folder) == before


def test_destination_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "out.ucf"
    path.write_text("x")
    assert_user_error(invoke("convert", ZERO2, path, "--overwrite"), "exists and is a file")
    assert path.read_text() == "x"


# --- bad stores for inspect and verify: exit 2, one line, nothing modified ---------------------
def _newer_version(store: Path, tmp_path: Path) -> Path:
    path = copy_store(store, tmp_path)
    manifest = json.loads((path / "ucformat.json").read_text())
    manifest["format_version"] = "4.0"
    (path / "ucformat.json").write_text(json.dumps(manifest))
    return path


def _incomplete(store: Path, tmp_path: Path) -> Path:
    path = copy_store(store, tmp_path)
    (path / "ucformat.json").unlink()
    return path


def _plain_zarr(store: Path, tmp_path: Path) -> Path:
    zarr.create_group(tmp_path / "plain.zarr", zarr_format=3, attributes={"x": 1})
    return tmp_path / "plain.zarr"


BAD_STORES: dict[str, tuple[Callable[[Path, Path], Path], list[str]]] = {
    "missing": (lambda s, t: t / "nope.ucf", ["nope.ucf: no such store"]),
    "empty folder": (lambda s, t: _empty(t), ["not a ucformat store (no ucformat.json and no"]),
    "a file": (lambda s, t: _file(t), ["ckpt.pt: is a file, not a ucformat store"]),
    "a DeepSpeed folder": (lambda s, t: ZERO2, ["not a ucformat store"]),
    "a plain zarr store": (_plain_zarr, ["a zarr store, but not a ucformat one"]),
    "incomplete": (_incomplete, ["incomplete ucformat store", "--overwrite"]),
    "newer format": (_newer_version, ["format 4.0, but this ucformat reads format 3.x"]),
}


@pytest.mark.parametrize(
    "args",
    [["inspect", "foo://ckpt.ucf"], ["verify", "foo://ckpt.ucf"],
     ["convert", str(ZERO2), "foo://ckpt.ucf"],
     ["export", "safetensors", "foo://ckpt.ucf", "out"]],
    ids=["inspect", "verify", "convert", "export"],
)  # fmt: skip
def test_an_unusable_store_url_is_one_line_exit_2(args: list[str]) -> None:
    assert_user_error(invoke(*args), "foo://ckpt.ucf: cannot open this URL", "Protocol not known")


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("case", list(BAD_STORES))
def test_bad_store_is_one_line_exit_2(store: Path, tmp_path: Path, case: str, command: str) -> None:
    build, fragments = BAD_STORES[case]
    path = build(store, tmp_path)
    before = snapshot(path)
    assert_user_error(invoke(command, path), *fragments)
    assert snapshot(path) == before


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda t: t / "nope", "nope: no such file or directory"),
        (_not_deepspeed, "not a DeepSpeed ZeRO model-states file"),
        (_truncated(OPTIM1), "not a complete zip archive"),
    ],
)
def test_verify_against_a_bad_source_is_exit_2(
    store: Path, tmp_path: Path, build: Callable[[Path], Path], fragment: str
) -> None:
    assert_user_error(invoke("verify", store, "--against", build(tmp_path)), fragment)


# --- real processes: the exit codes a shell sees ----------------------------------------------
def test_exit_codes_of_the_installed_command(store: Path, tmp_path: Path) -> None:
    def run(*args: object) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "ucformat_cli.main", *map(str, args)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)

    missing = run("verify", tmp_path / "nope.ucf")
    assert (missing.returncode, missing.stdout) == (2, "")
    assert missing.stderr.splitlines() == [f"error: {tmp_path / 'nope.ucf'}: no such store."]
    path = copy_store(store, tmp_path)
    _flip_byte(
        path / shard_key(ucformat.open(store).manifest.params["emb.weight"].states["fp32"], (0, 0))
    )
    damaged = run("verify", path)
    assert damaged.returncode == 1 and damaged.stderr == ""
    assert damaged.stdout.splitlines()[-1].startswith("FAILED: ")
