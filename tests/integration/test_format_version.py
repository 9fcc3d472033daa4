"""The version a store says follows its layout (docs/format.md §5, §5.3).

Format 3.0 only adds box chunks to 2.1. Converted from real DeepSpeed checkpoints: the grid's
``wide`` model (matrices of 2 and 4 MiB, box-chunked by default) makes a 3.0 store; the same
checkpoint with ``tp_max=1`` and the small ``simple`` model (flat chunks only) make 2.1 stores,
which format-2 readers read. A 2.1 manifest over box chunks is reported by ``verify``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import ucformat
from tests.integration.test_forward_compat import redigest
from ucformat.layout.chunking import is_flat_chunking

pytestmark = pytest.mark.deepspeed

WIDE = "z1-fp32-dsadam-wide-ws2"
SIMPLE = "z1-fp32-dsadam-simple-ws2"


def _versions(store: Path) -> tuple[str, str]:
    manifest = json.loads((store / "ucformat.json").read_text())
    root = json.loads((store / "zarr.json").read_text())
    return manifest["format_version"], root["attributes"]["ucformat"]["format_version"]


def _box_arrays(store: Path) -> list[str]:
    manifest = ucformat.open(store).manifest
    refs = [ref for entry in manifest.params.values() for ref in entry.states.values()]
    refs += [entry.array for entry in manifest.buffers.values()]
    return [ref.path for ref in refs if not is_flat_chunking(ref.shape, ref.chunk_shape)]


@pytest.fixture(scope="module")
def wide_store(ds_grid: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("version") / "wide.ucf"
    ucformat.convert(ds_grid / WIDE / "ckpt", out)
    return out


def test_box_chunks_make_a_format_3_store(wide_store: Path) -> None:
    assert _box_arrays(wide_store), "the wide model's matrices should get box chunks"
    assert _versions(wide_store) == ("3.0", "3.0")
    assert ucformat.verify(wide_store).ok


def test_flat_chunks_make_a_format_2_1_store(ds_grid: Path, tmp_path: Path) -> None:
    flat = ucformat.convert(ds_grid / WIDE / "ckpt", tmp_path / "flat.ucf", tp_max=1)
    assert flat.format_version == "2.1"
    assert not _box_arrays(tmp_path / "flat.ucf")
    assert _versions(tmp_path / "flat.ucf") == ("2.1", "2.1")
    ucformat.convert(ds_grid / SIMPLE / "ckpt", tmp_path / "simple.ucf")
    assert _versions(tmp_path / "simple.ucf") == ("2.1", "2.1")


def test_a_format_2_manifest_over_box_chunks_is_reported(wide_store: Path, tmp_path: Path) -> None:
    forged = tmp_path / "forged.ucf"
    shutil.copytree(wide_store, forged)
    document = json.loads((forged / "ucformat.json").read_text())
    document["format_version"] = "2.1"
    redigest(document)
    (forged / "ucformat.json").write_text(json.dumps(document))
    root = json.loads((forged / "zarr.json").read_text())
    root["attributes"]["ucformat"]["format_version"] = "2.1"
    (forged / "zarr.json").write_text(json.dumps(root))
    report = ucformat.verify(forged)
    messages = [problem.message for problem in report.problems]
    boxes = [m for m in messages if "is a box, which format 2.1 does not allow" in m]
    assert len(boxes) == len(_box_arrays(wide_store)), messages
    others = [m for m in messages if m not in boxes]
    assert others == [
        "arrays not checked: the manifest cannot be trusted (pass keep_going=True, or "
        "--keep-going, to check them anyway)"
    ], others
