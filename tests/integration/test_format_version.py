"""The version a store says follows its layout (docs/format.md §5, §5.3, §5.4).

This writer stacks every array (format 3.1), whatever its chunks: converted from real DeepSpeed
checkpoints, the grid's ``wide`` model (matrices of 2 and 4 MiB, box-chunked by default), the
same with ``tp_max=1`` and the small ``simple`` model all make 3.1 stores. Older layouts keep the
rules their versions had: a format-3.0 store (the golden store of box chunks) restamped 2.1 is
reported by ``verify`` for its box chunks, and a 3.1 store restamped 3.0 is refused for its
stacks (readers of 3.0 know no stacks).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import ucformat
from tests.conformance.make_golden import GOLDEN
from tests.integration.test_forward_compat import redigest
from ucformat.errors import ManifestError
from ucformat.layout.chunking import is_flat_chunking

WIDE = "z1-fp32-dsadam-wide-ws2"
SIMPLE = "z1-fp32-dsadam-simple-ws2"
BOXES_3_0 = "v3.0-z2-fp32-dsadam-ftb-box"  # a golden store of the format-3.0 writer


def _versions(store: Path) -> tuple[str, str]:
    manifest = json.loads((store / "ucformat.json").read_text())
    root = json.loads((store / "zarr.json").read_text())
    return manifest["format_version"], root["attributes"]["ucformat"]["format_version"]


def _box_arrays(store: Path) -> list[str]:
    manifest = ucformat.open(store).manifest
    return [
        name for name, ref in manifest.arrays() if not is_flat_chunking(ref.shape, ref.chunk_shape)
    ]


def _restamp(store: Path, out: Path, version: str) -> Path:
    shutil.copytree(store, out)
    document = json.loads((out / "ucformat.json").read_text())
    document["format_version"] = version
    redigest(document)
    (out / "ucformat.json").write_text(json.dumps(document))
    root = json.loads((out / "zarr.json").read_text())
    root["attributes"]["ucformat"]["format_version"] = version
    (out / "zarr.json").write_text(json.dumps(root))
    return out


@pytest.mark.deepspeed
def test_every_store_is_stacked_format_3_1(ds_grid: Path, tmp_path: Path) -> None:
    wide = tmp_path / "wide.ucf"
    ucformat.convert(ds_grid / WIDE / "ckpt", wide)
    assert _box_arrays(wide), "the wide model's matrices should get box chunks"
    flat = tmp_path / "flat.ucf"
    ucformat.convert(ds_grid / WIDE / "ckpt", flat, tp_max=1)
    assert not _box_arrays(flat)
    simple = tmp_path / "simple.ucf"
    ucformat.convert(ds_grid / SIMPLE / "ckpt", simple)
    for store in (wide, flat, simple):
        assert _versions(store) == ("3.1", "3.1")
        assert all(ref.stack is not None for _, ref in ucformat.open(store).manifest.arrays())
    assert ucformat.verify(wide).ok


def test_a_format_2_manifest_over_box_chunks_is_reported(tmp_path: Path) -> None:
    forged = _restamp(GOLDEN / BOXES_3_0, tmp_path / "forged.ucf", "2.1")
    report = ucformat.verify(forged)
    messages = [problem.message for problem in report.problems]
    boxes = [m for m in messages if "is a box, which format 2.1 does not allow" in m]
    assert len(boxes) == len(_box_arrays(GOLDEN / BOXES_3_0)) > 0, messages
    others = [m for m in messages if m not in boxes]
    assert others == [
        "arrays not checked: the manifest cannot be trusted (pass keep_going=True, or "
        "--keep-going, to check them anyway)"
    ], others


def test_a_format_3_0_manifest_over_stacks_is_refused(tmp_path: Path) -> None:
    forged = _restamp(GOLDEN / "v3.1-z1-fp16-tadam-ftb", tmp_path / "forged.ucf", "3.0")
    with pytest.raises(ManifestError, match=r"is stacked, which format 3\.0 does not allow"):
        ucformat.open(forged)
    report = ucformat.verify(forged)
    assert [p.kind for p in report.problems] == ["manifest"]
    assert "stacks are format 3.1" in report.problems[0].message


def test_a_format_3_0_store_loads_as_the_2_0_store_of_the_same_checkpoint() -> None:
    """The format-3.0 golden store (box chunks, one array per parameter and state) and the 2.0
    one were converted from the same DeepSpeed checkpoint (FusedAdam in AdamW mode): both load
    into a fresh model and AdamW with ``ucformat.torch.load`` to the same tensors."""
    import torch

    from tests.fixtures.models import build_model

    def loaded(store: Path) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, object]]]:
        model, groups = build_model("ftb")
        optimizer = torch.optim.AdamW(groups)
        ucformat.torch.load(model, optimizer, store)
        return model.state_dict(), optimizer.state_dict()["state"]

    (old_model, old_state), (new_model, new_state) = (
        loaded(GOLDEN / "z2-fp32-dsadam-ftb"),
        loaded(GOLDEN / BOXES_3_0),
    )
    assert old_model.keys() == new_model.keys() and old_state.keys() == new_state.keys()
    assert all(torch.equal(old_model[k], new_model[k]) for k in old_model)
    for index, state in old_state.items():
        for key, value in state.items():
            other = new_state[index][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
