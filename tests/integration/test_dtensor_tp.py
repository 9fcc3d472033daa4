"""DTensor tensor parallel and FSDP2 + TP models through ucformat stores, on CPU with gloo.

Every case runs in torchrun launches of tests/fixtures/run_tp.py (worker
tests/fixtures/_tp_worker.py; sources cached under tests/.cache/dtensor_tp):

* stock ``dcp.save`` of a model trained with TP (``parallelize_module`` colwise/rowwise on a
  1-D mesh of 2: ``Shard(0)``, ``Shard(1)``, ``Replicate()``, plain params), with FSDP2 at 2
  and with FSDP2 + TP on a 2 x 2 mesh (``_StridedShard``, uneven rows) -> ``ucformat convert``
  -> a fresh model in each of TP (W=2), FSDP2 (W=2) and FSDP2 + TP (2 x 2) with a fresh AdamW
  via ``ucformat.torch.load``: every gathered param and optimizer state equals the source's
  bit for bit, optimizer states are DTensors placed like their params, one more step trains;
* ``ucformat.torch.save`` from TP and FSDP2 + TP writes the same arrays, steps and groups as
  ``ucformat convert`` of a stock ``dcp.save`` of the same state, and loads back bit-exact at
  other meshes (TP-only, FSDP2-only, a plain single-process model);
* read cost: each rank's bytes read equal the read planner's prediction byte for byte; on the
  matrices of at least 1 MiB (box chunks, docs/format.md §2.2) each rank reads at most 1.2x
  the bytes it needs in every layout, ``Shard(1)`` column blocks included; the amplification
  (read / needed) is recorded in docs/benchmarks.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ucformat
from tests.fixtures.run_tp import SAVES, SOURCES, TARGETS, run_tp

pytestmark = pytest.mark.deepspeed  # the worker serves jobs through DeepSpeed's comm helpers

LOADS = [
    (source.name, layout, world)
    for world, layouts in TARGETS.items()
    for layout in layouts
    for source in SOURCES
]
SAVED_LOADS = [
    ("save-fsdp2tp-2x2", "tp"), ("save-fsdp2tp-2x2", "fsdp2"), ("save-fsdp2tp-2x2", "plain"),
    ("save-tp-w2", "fsdp2"), ("save-tp-w2", "plain"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    pytest.importorskip("deepspeed")
    work = tmp_path_factory.mktemp("tp")
    return run_tp(work), work


def _check(results: dict[str, Any], name: str) -> dict[str, Any]:
    result: dict[str, Any] = results[name]
    assert result["failures"] == [], "\n".join(result["failures"])
    return result


@pytest.mark.parametrize(("source", "layout", "world"), LOADS,
                         ids=[f"{s}-to-{t}-w{w}" for s, t, w in LOADS])  # fmt: skip
def test_dcp_source_loads_into_tp_targets(
    tp_results: tuple[dict[str, Any], Path], source: str, layout: str, world: int
) -> None:
    result = _check(tp_results[0], f"{source}--to-{layout}-w{world}")
    assert result["bytes_read"] == result["bytes_predicted"], "reads differ from the planner's"
    needed = sum(result["bytes_needed"])
    assert needed > 0
    if layout == "fsdp2":  # row blocks: one range per array, only chunk rounding on top
        assert sum(result["bytes_read"]) <= 1.1 * needed
    else:  # the small emb/head matrices are one chunk each, read whole by every rank
        assert sum(result["bytes_read"]) <= 1.35 * needed
    _check_large(result)
    placements = result["placements"]  # the target really holds the layouts under test
    if layout == "fsdp2tp":
        assert placements["up.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert placements["down.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert placements["down.bias"] == "(Shard(dim=0), Replicate())"
    elif layout == "tp":
        assert placements["down.weight"] == "(Shard(dim=1),)"
        assert placements["down.bias"] == "(Replicate(),)"
        assert placements["norm.weight"] == "plain"


@pytest.mark.parametrize(
    ("name", "layout"), SAVED_LOADS, ids=[f"{n}-to-{t}" for n, t in SAVED_LOADS]
)
def test_saved_store_loads_at_other_meshes(
    tp_results: tuple[dict[str, Any], Path], name: str, layout: str
) -> None:
    result = _check(tp_results[0], f"{name}--to-{layout}-w2")
    assert result["bytes_read"] == result["bytes_predicted"]
    _check_large(result)


def _check_large(result: dict[str, Any]) -> None:
    """Every rank reads at most 1.2x what it needs of the matrices of at least 1 MiB."""
    for read, needed in zip(result["large_read"], result["large_needed"], strict=True):
        assert needed > 0
        assert read <= 1.2 * needed, (read, needed, read / needed)


def _arrays(store: Path) -> dict[tuple[str, str], Any]:
    ckpt = ucformat.open(store)
    out: dict[tuple[str, str], Any] = {}
    for name, entry in ckpt.manifest.params.items():
        for key in [*entry.states, *entry.scalars]:
            out[(name, key)] = ckpt.read(name, key)
    return out


@pytest.mark.parametrize(("name", "layout", "world"), SAVES, ids=[n for n, _, _ in SAVES])
def test_save_equals_convert_of_dcp_save(
    tp_results: tuple[dict[str, Any], Path], name: str, layout: str, world: int
) -> None:
    results, work = tp_results
    _check(results, name)
    saved = work / "stores" / f"{name}.ucf"
    converted = work / "stores" / f"{name}.dcp.ucf"
    ucformat.convert(work / "stores" / f"{name}.dcp", converted, overwrite=True)
    ours, theirs = _arrays(saved), _arrays(converted)
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == ours[key].dtype and value.shape == ours[key].shape, key
            assert torch.equal(
                value.reshape(-1).view(torch.uint8), ours[key].reshape(-1).view(torch.uint8)
            ), key
        else:
            assert float(value) == float(ours[key]), key
    a, b = ucformat.open(saved).manifest, ucformat.open(converted).manifest
    assert a.optimizer is not None and b.optimizer is not None
    assert [sorted(g.params) for g in a.optimizer.groups] == [
        sorted(g.params) for g in b.optimizer.groups
    ]
    for ga, gb in zip(a.optimizer.groups, b.optimizer.groups, strict=True):
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert ga.hyperparams[key] == gb.hyperparams[key], key
    assert a.source.mesh_shape == ([2, 2] if layout == "fsdp2tp" else [2])
