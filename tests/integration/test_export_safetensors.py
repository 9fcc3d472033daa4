"""DeepSpeed -> convert -> ``export safetensors`` -> safetensors' own ``load_file`` -> truth.

Runs on the committed fixtures (no DeepSpeed needed): every tensor must equal the ground truth
read from the live DeepSpeed engine, bit for bit, and a fresh model must accept the files the
way transformers loads them (tied aliases re-tied, nothing unexpected).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import ucformat
from tests.fixtures.models import build_model
from tests.truth import assert_exact, load_truth
from ucformat.errors import StoreExistsError
from ucformat.export import export_safetensors

safetensors_torch = pytest.importorskip("safetensors.torch")

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"
CASES = sorted(p.name for p in DATA.iterdir() if (p / "truth.pt").exists())
LP = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stores")
    out = {}
    for case in CASES:
        out[case] = root / f"{case}.ucf"
        ucformat.convert(DATA / case / "ckpt", out[case])
    return out


def load_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export, through the index when there is one (as transformers does)."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return dict(safetensors_torch.load_file(folder / "model.safetensors"))
    weight_map = json.loads(index.read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(weight_map.values())):
        tensors.update(safetensors_torch.load_file(folder / name))
    assert set(tensors) == set(weight_map)
    return tensors


def expected_keys(truth: dict[str, Any]) -> set[str]:
    return set(truth["fp32"]) | set(truth["frozen"]) | set(truth["buffers"])


@pytest.mark.parametrize("case", CASES)
def test_fp32_export_equals_truth(case: str, stores: dict[str, Path], tmp_path: Path) -> None:
    truth = load_truth(DATA / case)
    result = export_safetensors(stores[case], tmp_path)
    assert result.files == ["model.safetensors"] and not result.dry_run
    assert result.summary.startswith(f"wrote {len(expected_keys(truth))} tensors")
    tensors = load_folder(tmp_path)
    assert set(tensors) == expected_keys(truth)  # tied aliases are not stored
    for name, want in truth["fp32"].items():
        assert_exact(tensors[name], want, f"{name} (fp32 master)")
    for name, want in truth["frozen"].items():
        assert_exact(tensors[name], want.float(), f"{name} (frozen, upcast)")
    for name, want in truth["buffers"].items():
        assert_exact(tensors[name], want, f"{name} (buffer, own dtype)")
    if truth["shared_params"]:
        assert any("tied aliases not stored" in note for note in result.notes)


@pytest.mark.parametrize("case", CASES)
def test_training_dtype_export_loads_into_the_model(
    case: str, stores: dict[str, Path], tmp_path: Path
) -> None:
    truth = load_truth(DATA / case)
    dtype = truth["case"]["dtype"]
    export_safetensors(stores[case], tmp_path, dtype=dtype)
    tensors = load_folder(tmp_path)
    for name, want in truth["module"].items():  # lp weights exactly as DeepSpeed held them
        if name in tensors:
            assert_exact(tensors[name], want, f"{name} ({dtype})")
    model, _ = build_model(truth["case"]["model"], seed=4321)
    for param in model.parameters():  # DeepSpeed casts parameters, not buffers
        param.data = param.data.to(LP[dtype])
    result = model.load_state_dict(tensors, strict=False)
    assert result.unexpected_keys == []
    assert sorted(result.missing_keys) == sorted(truth["shared_params"])  # re-tied aliases
    for name, want in truth["module"].items():
        assert_exact(model.state_dict()[name], want, f"model {name}")


def test_sharded_export_matches_single_file(stores: dict[str, Path], tmp_path: Path) -> None:
    case = "z3-bf16-dsadam-ftb-ws4"
    export_safetensors(stores[case], tmp_path / "one")
    result = export_safetensors(stores[case], tmp_path / "many", max_shard_size=200)
    shards = [f for f in result.files if f.endswith(".safetensors")]
    assert len(shards) > 2 and result.files[-1] == "model.safetensors.index.json"
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == sorted(result.files)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    one, many = load_folder(tmp_path / "one"), load_folder(tmp_path / "many")
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in one.values()
    )
    assert one.keys() == many.keys()
    for name in one:
        assert_exact(many[name], one[name], name)
    for shard in shards:  # each file's payload fits, unless it is one oversized tensor
        tensors = safetensors_torch.load_file(tmp_path / "many" / shard)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 200 or len(tensors) == 1


def test_tied_copy_writes_every_alias(stores: dict[str, Path], tmp_path: Path) -> None:
    export_safetensors(stores["z2-fp32-dsadam-ftb-ws3"], tmp_path, tied="copy")
    tensors = load_folder(tmp_path)
    assert_exact(tensors["lm_head.weight"], tensors["emb.weight"], "alias copy")


def test_destination_rules(stores: dict[str, Path], tmp_path: Path) -> None:
    store = stores["z1-bf16-dsadam-simple-ws2"]
    plan = export_safetensors(store, tmp_path / "dry", dry_run=True, max_shard_size=300)
    assert plan.dry_run and not (tmp_path / "dry").exists()
    assert plan.summary.startswith("would write")
    export_safetensors(store, tmp_path / "out", max_shard_size=300)
    (tmp_path / "out" / "README.md").write_text("mine")
    with pytest.raises(StoreExistsError, match="is not empty; pass overwrite=True"):
        export_safetensors(store, tmp_path / "out")
    export_safetensors(store, tmp_path / "out", overwrite=True)  # one file replaces the shards
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "README.md",
        "model.safetensors",
    ]
