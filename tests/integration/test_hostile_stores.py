"""Hostile manifests and shard indexes (issue #21 items 4-6): one line, exit code 2, bounded.

Each case edits a real converted store the way an attacker would (recomputing the digest, or a
shard index's crc32c, so that the edit is not caught as damage) and runs what a user runs on it:
``inspect``, ``verify``, ``export``, reads. Each must stop in one line (exit code 2; ``verify``
reports the problem and exits 1) within a few seconds, and nothing is read or written outside
the store and the export folder.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest

import ucformat
from tests.cli.helpers import assert_user_error, invoke
from ucformat.errors import CorruptDataError, ManifestError, OutOfRangeError, UCFormatError
from ucformat.store.manifest_io import MAX_MANIFEST_BYTES, document_digest

SOURCE = Path(__file__).resolve().parents[1] / "fixtures" / "data" / "z3-bf16-dsadam-ftb-ws4"
#: What a hostile input may take, per command (a loaded 2-core machine included).
BOUND_S = 20.0


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("hostile") / "s.ucf"
    ucformat.convert(SOURCE / "ckpt", store, chunk_bytes=64, shard_bytes=256)
    return store


@pytest.fixture
def store(pristine: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "deep" / "er" / "s.ucf"
    shutil.copytree(pristine, copy)
    return copy


def _edit(store: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the manifest and recompute its digest (what an attacker can always do)."""
    document = json.loads((store / "ucformat.json").read_bytes())
    edit(document)
    document["digest"] = None
    document["digest"] = document_digest(document)
    (store / "ucformat.json").write_text(json.dumps(document))


def _first_param(document: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = next(iter(document["params"].values()))
    return entry


def _timed(*args: object) -> Any:
    started = time.perf_counter()
    result = invoke(*args)
    assert time.perf_counter() - started < BOUND_S, args
    assert "Traceback" not in result.output
    return result


def _refused_everywhere(store: Path, *fragments: str) -> None:
    """inspect and export fail in one line; verify reports it; open raises a ucformat error."""
    assert_user_error(_timed("inspect", store), *fragments)
    out = store.parent / "out"
    assert_user_error(_timed("export", "safetensors", store, out, "-q"), *fragments)
    assert not out.exists()
    verified = _timed("verify", store)
    if verified.exit_code == 2:  # refused before it could be checked: one line
        assert_user_error(verified, *fragments)
    else:  # checked: the problem is reported
        assert verified.exit_code == 1 and "FAILED" in verified.stdout.splitlines()[-1]
        assert fragments[-1] in verified.stdout
    with pytest.raises(ManifestError):
        ucformat.open(store)


def test_deep_nesting(store: Path) -> None:
    depth = 100_000
    (store / "ucformat.json").write_text(
        '{"format": "ucformat", "format_version": "2.0", "x": ' + "[" * depth + "]" * depth + "}"
    )
    _refused_everywhere(store, "JSON nested 100001 levels deep, more than the 200")


def test_huge_manifest(store: Path) -> None:
    with open(store / "ucformat.json", "wb") as handle:
        handle.write(b'{"format": "ucformat", "s": "')
        handle.write(b"a" * (MAX_MANIFEST_BYTES + 10))
        handle.write(b'"}')
    _refused_everywhere(store, "more than the 67108864 a manifest may have")


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda d: _first_param(d).update(shape=[10**15]), "elements"),
        (
            lambda d: next(iter(_first_param(d)["states"].values())).update(
                shape=[10**8, 10**7], chunk_shape=[1, 10**7], shard_shape=[1, 10**7]
            ),
            "more than 140737488355328 elements",
        ),
        (
            lambda d: next(iter(_first_param(d)["states"].values())).update(
                chunk_shape=[0] * len(_first_param(d)["shape"])
            ),
            "must be at least 1",
        ),
        (
            lambda d: _first_param(d)["states"].update(
                {"../../evil": next(iter(_first_param(d)["states"].values()))}
            ),
            "a state name must be an identifier",
        ),
        (
            lambda d: next(iter(_first_param(d)["states"].values())).update(
                path="../elsewhere/fp32"
            ),
            "which is no stack path",
        ),
        (
            lambda d: next(iter(_first_param(d)["states"].values()))["stack"].update(index=10**9),
            "is not below the stack size",
        ),
        (
            lambda d: [s["stack"].update(size=10**9) for s in _first_param(d)["states"].values()],
            "holds 1000000000 arrays but the manifest names",
        ),
        (lambda d: d["source"].update(tag="../../../../tag-escape"), "holds '/'"),
        (lambda d: d["source"].update(tag=".."), "is not a file name"),
        (lambda d: _first_param(d).update(aliases=["../../escape"]), "alias '../../escape'"),
        (lambda d: d["tied"].update({"/abs/evil": next(iter(d["params"]))}), "'/abs/evil'"),
        (lambda d: d["tied"].update({"a\nb": next(iter(d["params"]))}), "control character"),
        (
            lambda d: d["source"].update(files=[{"name": "../../../etc/passwd", "size": 1}]),
            "is not a file name",
        ),
    ],
    ids=[
        "1e15-elements",
        "1e15-elements-array",
        "chunk-0",
        "state-name",
        "array-path",
        "stack-index",
        "stack-size",
        "tag-escape",
        "tag-dotdot",
        "alias",
        "tied-absolute",
        "tied-newline",
        "source-file",
    ],
)
def test_hostile_manifest_fields(
    store: Path, edit: Callable[[dict[str, Any]], None], fragment: str
) -> None:
    _edit(store, edit)
    _refused_everywhere(store, "invalid manifest at", fragment)
    run_folder = store.parent.parent
    before = sorted(p.name for p in run_folder.iterdir())
    out = store.parent / "out" / "a" / "b" / "c"
    assert_user_error(_timed("export", "deepspeed-universal", store, out, "-q"), fragment)
    assert sorted(p.name for p in run_folder.iterdir()) == before  # nothing written above


def test_digest_mismatch_stops_verify(store: Path) -> None:
    document = json.loads((store / "ucformat.json").read_bytes())
    _first_param(document)["shape"] = [10**14]  # within the caps, but the digest is not redone
    (store / "ucformat.json").write_text(json.dumps(document))
    result = _timed("verify", store)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0] == "ucformat.json: digest mismatch: edited after it was written"
    assert lines[-2] == (
        "ucformat.json: arrays not checked: the manifest cannot be trusted (pass "
        "keep_going=True, or --keep-going, to check them anyway)"
    )
    assert " 0 arrays, 0 shards" in lines[-1]


def _hostile_index(store: Path) -> Path:
    """Point the first chunk of a shard at offset 2**64 - 8, with a valid index crc32c."""
    manifest = json.loads((store / "ucformat.json").read_bytes())
    ref = next(
        array
        for entry in manifest["params"].values()
        for array in entry["states"].values()
        if len(array["shape"]) == 2 and array["shard_shape"] != array["chunk_shape"]
    )
    stack = ref["stack"]  # the first shard of its own (format 3.1: in its stack)
    shard = store / ref["path"] / f"c.{stack['index'] // stack['per_shard']}.0.0"
    data = bytearray(shard.read_bytes())
    # the index ends the object: (offset, nbytes) uint64 pairs, then its crc32c
    chunks = int(
        np.prod([s // c for s, c in zip(ref["shard_shape"], ref["chunk_shape"], strict=True)])
    )
    start = len(data) - chunks * 16 - 4
    entries = np.frombuffer(bytes(data[start : start + chunks * 16]), dtype="<u8").copy()
    entries[0] = 2**64 - 8
    body = entries.tobytes()
    data[start : start + chunks * 16] = body
    data[-4:] = crc32c.crc32c(body).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    return shard


def test_hostile_shard_index(store: Path) -> None:
    shard = _hostile_index(store)
    key = shard.relative_to(store).as_posix()
    verified = _timed("verify", store)
    assert verified.exit_code == 1, verified.output
    path = key.rpartition("/")[0]
    assert path in verified.stdout
    ckpt = ucformat.open(store)
    index = int(key.rpartition("/c.")[2].split(".")[0])
    name = next(n for n, r in ckpt.manifest.arrays() if r.path == path and r.stack
                and r.stack.index == index)  # fmt: skip
    fqn, state = name.removeprefix("params/").rsplit("/", 1)
    with pytest.raises((CorruptDataError, UCFormatError)):
        ckpt.read(fqn, state)
    result = _timed("export", "safetensors", store, store.parent / "out", "-q")
    assert_user_error(result)


def test_read_range_checks_its_bounds(pristine: Path) -> None:
    ckpt = ucformat.open(pristine)
    name = next(iter(ckpt.manifest.params))
    numel = ckpt.manifest.params[name].numel
    for start, stop in [(-1, 2), (0, numel + 1), (3, 2), (2**63, 2**64)]:
        with pytest.raises(OutOfRangeError) as info:
            ckpt.read_range(name, "fp32", start, stop)
        assert str(info.value) == (
            f"{name} fp32: elements [{start}, {stop}) are outside the array's [0, {numel}); "
            f"give 0 <= start <= stop <= {numel}."
        )
