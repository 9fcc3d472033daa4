"""Megatron-Core's parallel layout (pure): TP boxes, pipeline stages, EP ranks, writer ranks; the
store in Megatron's terms (keys on prepended axes, the param groups a job at another layout
has). Checked against Megatron's own files in tests/integration/test_export_megatron.py."""

from __future__ import annotations

import math

import pytest

from ucformat.errors import UnsupportedExportError
from ucformat.format.megatron import MegatronLayout, MegatronParam
from ucformat.format.megatron_state import (
    common_step,
    content_metadata,
    job_param_groups,
    megatron_keys,
    optimizer_common,
    store_state,
)
from ucformat.format.models import (
    CheckpointManifest,
    OptimizerGroup,
    OptimizerInfo,
    ParamEntry,
    ScalarState,
)
from ucformat.layout.megatron import (
    MegatronGrid,
    expert_rank,
    layer_stage,
    split_dim,
    stage_layers,
    tp_boxes,
)


def _cells(boxes: list, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out = []
    for box in boxes:
        ranges = [range(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True)]
        out += [(box.tp_rank, *cell) for cell in _product(ranges)]
    return out


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    cells: list[tuple[int, ...]] = [()]
    for r in ranges:
        cells = [(*c, i) for c in cells for i in r]
    return cells


@pytest.mark.parametrize(
    ("key", "dim"),
    [
        ("decoder.layers.self_attention.linear_qkv.weight", 0),
        ("decoder.layers.self_attention.linear_qkv.bias", 0),
        ("decoder.layers.self_attention.linear_proj.weight", 1),
        ("decoder.layers.self_attention.linear_proj.bias", None),
        ("decoder.layers.mlp.experts.experts.linear_fc2.weight", 1),
        ("embedding.word_embeddings.weight", 0),
        ("output_layer.weight", 0),
        ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", None),
        ("decoder.layers.mlp.router.weight", None),
        ("decoder.final_layernorm.weight", None),
    ],
)
def test_split_dims(key: str, dim: int | None) -> None:
    assert split_dim(key) == dim


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_boxes_tile_the_parameter(tp: int) -> None:
    shape = (8, 4)
    for dim, halves in ((0, ()), (1, ()), (0, (4, 4)), (None, ())):
        boxes = tp_boxes("w", shape, dim, tp, halves)
        cells = _cells(boxes, shape)
        assert sorted(c[1:] for c in cells) == _product([range(8), range(4)])
        if dim is None:
            assert [b.tp_rank for b in boxes] == [0]
        else:
            assert {b.tp_rank for b in boxes} == set(range(tp if dim is not None else 1))


def test_swiglu_halves_split_one_by_one() -> None:
    """TP rank r holds its slice of the gate and its slice of the up projection."""
    boxes = tp_boxes("fc1", (96, 32), 0, 2, (48, 48))
    assert [(b.tp_rank, b.offsets[0], b.sizes[0]) for b in boxes] == [
        (0, 0, 24), (0, 48, 24), (1, 24, 24), (1, 72, 24),
    ]  # fmt: skip
    assert len(tp_boxes("fc1", (96, 32), 0, 1, (48, 48))) == 2  # apart even at TP=1


def test_tp_boxes_refuse_an_uneven_split() -> None:
    with pytest.raises(UnsupportedExportError, match=r"dim 0 .* not divisible by --tp 3"):
        tp_boxes("w", (8, 4), 0, 3)
    with pytest.raises(UnsupportedExportError, match="part of 6"):
        tp_boxes("w", (12, 4), 0, 4, (6, 6))


def test_stages_even_uneven_and_virtual() -> None:
    assert stage_layers(4, 2) == [2, 2]
    assert stage_layers(3, 2, first=1) == [1, 2]
    assert stage_layers(5, 3, first=1, last=2) == [1, 2, 2]
    sizes = stage_layers(4, 2, vpp=2)  # chunks 0..3, chunk c on pipeline rank c % 2
    assert sizes == [1, 1, 1, 1]
    assert [layer_stage(layer, "decoder.layers.x", sizes, 2) for layer in range(4)] == [0, 1, 0, 1]
    assert layer_stage(None, "output_layer.weight", sizes, 2) == 1
    assert layer_stage(None, "embedding.word_embeddings.weight", sizes, 2) == 0
    for bad in ((3, 2, None, None, 1), (4, 2, 1, None, 2), (4, 2, 3, 3, 1)):
        with pytest.raises(UnsupportedExportError):
            stage_layers(*bad)


def test_expert_and_writer_ranks() -> None:
    assert [expert_rank(e, 4, 2) for e in range(4)] == [0, 0, 1, 1]
    with pytest.raises(UnsupportedExportError, match="4 experts do not split evenly"):
        expert_rank(0, 4, 3)
    grid = MegatronGrid(tp=2, pp=2, ep=2)
    assert grid.world_size == 8 and grid.dp == 2
    ranks = {grid.rank(t, p, d) for t in range(2) for p in range(2) for d in range(2)}
    assert ranks == set(range(8))
    assert grid.rank(1, 0, 0) == 1 and grid.rank(0, 0, 1) == 2 and grid.rank(0, 1, 0) == 4
    with pytest.raises(UnsupportedExportError, match="--tp must be at least 1"):
        MegatronGrid(tp=0)
    # experts with their own TP: EP=2 x ETP=2 at TP=1 needs 4 ranks (DP=4 for the dense part)
    experts = MegatronGrid(tp=1, ep=2, etp=2)
    assert (experts.world_size, experts.dp, experts.expert_tp) == (4, 4, 2)
    assert [experts.expert_rank(t, e, 0) for e in range(2) for t in range(2)] == [0, 1, 2, 3]
    staged = MegatronGrid(tp=2, pp=2, ep=2, etp=1)  # world lcm(2, 2) * 2 = 4
    assert staged.world_size == 4 and staged.expert_rank(0, 1, 1) == 3


# --- the store in Megatron's terms ----------------------------------------------------------


def _manifest(
    params: dict[str, tuple[list[int], MegatronParam, int]],
    groups: list[dict],
    step: float = 3.0,
) -> CheckpointManifest:
    """A tiny manifest: name -> (shape, Megatron key/axes, group)."""
    entries = {
        name: ParamEntry(
            shape=shape, dtype="float32", requires_grad=True, group=group, states={},
            scalars={"step": ScalarState(kind="float", value=step)},
        )
        for name, (shape, _, group) in params.items()
    }  # fmt: skip
    members: list[list[str]] = [[] for _ in groups]
    for name, (_, _, group) in params.items():
        members[group].append(name)
    pairs = zip(members, groups, strict=True)
    optimizer = OptimizerInfo(
        name="adam", adam_w_mode=True, state_keys=[], scalar_keys=["step"],
        groups=[OptimizerGroup(params=m, hyperparams=h) for m, h in pairs],
    )  # fmt: skip
    layout = MegatronLayout(
        sharded_backend="torch_dist", optimizer_stored=True, num_layers=2,
        params={name: meta for name, (_, meta, _) in params.items()},
    )  # fmt: skip
    base = CheckpointManifest.model_construct()
    return base.model_copy(update={"params": entries, "optimizer": optimizer, "megatron": layout})


_DENSE = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}


def _moe_manifest(step: float = 3.0) -> CheckpointManifest:
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    params = {
        f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc2.weight": (
            [4, 2],
            MegatronParam(key=key, layer=layer, axes=["layer", "expert"], expert=e),
            1,
        )
        for layer in range(2)
        for e in range(2)
    }
    params["decoder.layers.0.norm"] = (
        [4],
        MegatronParam(key="decoder.layers.norm", layer=0),
        0,
    )
    params["decoder.layers.1.norm"] = ([4], MegatronParam(key="decoder.layers.norm", layer=1), 0)
    groups = [
        {**_DENSE, "lr": 0.1, "wd_mult": 0.0},
        {**_DENSE, "lr": 0.1, "is_expert_parallel": True},
    ]
    return _manifest(params, groups, step)


def test_keys_tile_their_global_tensors() -> None:
    keys = megatron_keys(_moe_manifest())
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    assert keys.axes[key] == (2, 2) and keys.global_shape(key) == (2, 2, 4, 2)
    assert keys.by_index[(key, (1, 0))].startswith("decoder.layers.1.mlp.experts.local_experts.0")
    assert keys.axes["decoder.layers.norm"] == (2,)  # format 3.0: the layer axis implied
    entry = keys.entries["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert (entry.layer, entry.expert, entry.index) == (1, 1, (1, 1))


def test_keys_refuse_a_missing_layer() -> None:
    manifest = _moe_manifest()
    params = dict(manifest.params)
    del params["decoder.layers.1.norm"]
    assert manifest.megatron is not None
    layout = manifest.megatron.model_copy(
        update={"params": {n: m for n, m in manifest.megatron.params.items() if n in params}}
    )
    partial = manifest.model_copy(update={"params": params, "megatron": layout})
    with pytest.raises(UnsupportedExportError, match="do not fill its axes"):
        megatron_keys(partial)


def test_groups_follow_expert_parallelism() -> None:
    """At EP=1 the expert group joins the dense one of the same identity; at EP>1 it stays."""
    manifest = _moe_manifest()
    kept = job_param_groups(manifest, distributed=True, expert_parallel=True)
    assert [g["is_expert_parallel"] for g in kept] == [False, True]
    assert all(g["step"] == 3.0 for g in kept)
    merged = job_param_groups(manifest, distributed=False, expert_parallel=False)
    assert [(g["wd_mult"], g["is_expert_parallel"]) for g in merged] == [(0.0, False), (1.0, False)]
    assert all("step" not in g for g in merged)


def test_common_state_and_step() -> None:
    manifest = _moe_manifest(step=7.0)
    assert common_step(manifest) == 7.0
    assert store_state("param") == "fp32" and store_state("fp32_param") == "fp32"
    assert store_state("exp_avg") == "exp_avg"
    groups = [{"lr": 1.0}]
    assert optimizer_common(groups, distributed=True, float16=False, step=None) == {
        "optimizer": {"param_groups": groups},
        "param_state_sharding_type": "fully_reshardable",
    }
    assert optimizer_common(groups, distributed=False, float16=True, step=5) == {
        "optimizer": {"state": {"common_step": 5}, "param_groups": groups}
    }
    assert content_metadata(False) == {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }
    assert math.isclose(common_step(_moe_manifest(step=2.5)) or 0, 2.5)
