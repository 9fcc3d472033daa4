"""Export planning as data: no tensor is read, no file written, no DeepSpeed imported."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers import array_ref, source_info
from ucformat.errors import UnsupportedExportError
from ucformat.export.common import parse_dtype, parse_size
from ucformat.export.deepspeed_universal import plan_deepspeed_universal
from ucformat.export.native_target import (
    BF16_OPTIMIZER,
    STAGE3_OPTIMIZER,
    ZERO_OPTIMIZER,
    native_target,
    plan_native,
)
from ucformat.export.safetensors import _shards, plan_safetensors
from ucformat.format.models import (
    BufferEntry,
    CheckpointManifest,
    OptimizerGroup,
    OptimizerInfo,
    ParamEntry,
    ScalarState,
)
from ucformat.layout.partition import PartitionedFlatLayout

#: The ``multi`` fixture model's two param groups (reference §4.4, example B).
MULTI = [
    [("c.weight", [4, 3]), ("b.weight", [3, 5]), ("a.weight", [5, 7])],
    [("a.bias", [5]), ("b.bias", [3]), ("ln.weight", [3]), ("ln.bias", [3]), ("c.bias", [4])],
]


def make_manifest(
    groups: list[list[tuple[str, list[int]]]] = MULTI,
    *,
    dtype: str = "float32",
    frozen: tuple[tuple[str, list[int]], ...] = (),
    ds_config: dict[str, Any] | None = None,
    steps: dict[str, int] | None = None,
    optimizer: bool = True,
) -> CheckpointManifest:
    params: dict[str, ParamEntry] = {}
    for index, members in enumerate(groups):
        for name, shape in members:
            states = {s: array_ref(f"params/{name}/{s}", shape) for s in ("fp32", "exp_avg")}
            step = (steps or {}).get(name, 4)
            params[name] = ParamEntry(
                shape=shape, dtype=dtype, requires_grad=True, group=index, states=states,
                scalars={"step": ScalarState(kind="int", value=step)},
            )  # fmt: skip
    for name, shape in frozen:
        params[name] = ParamEntry(
            shape=shape, dtype=dtype, requires_grad=False, group=None,
            states={"fp32": array_ref(f"params/{name}/fp32", shape, dtype)},
        )  # fmt: skip
    info = OptimizerInfo(
        name="deepspeed.ops.adam.FusedAdam",
        adam_w_mode=True,
        state_keys=["exp_avg"],
        scalar_keys=["step"],
        groups=[
            OptimizerGroup(params=[n for n, _ in members], hyperparams={"lr": 0.001})
            for members in groups
        ],
    )
    return CheckpointManifest(
        created_by="tests",
        source=source_info(
            tag="global_step4",
            zero_stage=2,
            train_dtype=dtype,
            optimizer_wrapper=ZERO_OPTIMIZER,
            ds_config=ds_config if ds_config is not None else {"zero_optimization": {"stage": 2}},
        ),
        params=params,
        buffers={
            "bn.num_batches_tracked": BufferEntry(
                shape=[], dtype="int64", array=array_ref("buffers/bn.num_batches_tracked", [])
            )
        },
        tied={"lm_head.weight": "c.weight"},
        optimizer=info if optimizer else None,
    )


# --- options ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "size"),
    [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30), ("500MB", 5 * 10**8), ("100kib", 102400),
     ("1000", 1000), (7, 7), ("1.5KB", 1500)],
)  # fmt: skip
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["5 parsecs", "", "GB", "0"])
def test_parse_size_refuses(bad: str) -> None:
    with pytest.raises(UnsupportedExportError, match="size"):
        parse_size(bad)


def test_parse_dtype() -> None:
    assert [parse_dtype(x) for x in ("bf16", "FP16", "fp32", None)] == [
        "bfloat16", "float16", "float32", None,
    ]  # fmt: skip
    with pytest.raises(UnsupportedExportError, match="expected one of fp32, fp16, bf16"):
        parse_dtype("int8")


# --- safetensors -----------------------------------------------------------------------------
def test_hugging_face_shard_rule() -> None:
    assert _shards([4, 4, 4], 8) == [[0, 1], [2]]
    assert _shards([3, 20, 3], 8) == [[1], [0, 2]]  # an oversized tensor gets its own shard
    assert _shards([8, 8], 8) == [[0], [1]]
    assert _shards([], 8) == []


def test_single_file_header_is_complete_and_aligned() -> None:
    plan = plan_safetensors(make_manifest(frozen=(("frozen.weight", [2, 2]),)), dtype="bf16")
    assert [f.filename for f in plan.files] == ["model.safetensors"] and plan.index is None
    header = plan.files[0].header
    length = int.from_bytes(header[:8], "little")
    assert length == len(header) - 8 and len(header) % 8 == 0
    document = json.loads(header[8:])
    assert document.pop("__metadata__") == {"format": "pt"}
    assert "lm_head.weight" not in document  # tied alias dropped (transformers convention)
    assert plan.dropped_aliases == {"lm_head.weight": "c.weight"}
    assert document["c.weight"] == {"dtype": "BF16", "shape": [4, 3], "data_offsets": [0, 24]}
    assert document["bn.num_batches_tracked"]["dtype"] == "I64"  # buffers keep their dtype
    offsets = sorted(tuple(v["data_offsets"]) for v in document.values())
    assert all(a[1] == b[0] for a, b in itertools.pairwise(offsets))  # no holes
    assert offsets[-1][1] == plan.nbytes


def test_sharded_plan_and_index() -> None:
    plan = plan_safetensors(make_manifest(), max_shard_size=100, tied="copy", buffers=False)
    names = [f.filename for f in plan.files]
    assert names == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    assert [[item.key for item in f.items] for f in plan.files] == [
        ["c.weight", "lm_head.weight"],
        ["a.weight"],  # 140 bytes > 100: a shard of its own
        ["b.weight", "a.bias", "b.bias"],
        ["ln.weight", "ln.bias", "c.bias"],
    ]
    assert plan.index is not None
    weight_map = plan.index["weight_map"]
    assert isinstance(weight_map, dict) and weight_map["lm_head.weight"] == weight_map["c.weight"]
    assert plan.index["metadata"] == {"total_size": plan.nbytes}
    assert all(f.size - len(f.header) <= 100 or len(f.items) == 1 for f in plan.files)
    assert plan.filenames[-1] == "model.safetensors.index.json"


# --- native DeepSpeed target -----------------------------------------------------------------
def test_wrapper_follows_deepspeed_rules() -> None:
    manifest = make_manifest()
    accum = {"data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1}}
    offload = {**accum, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    cases = [
        (dict(stage=3, dtype="bf16"), None, STAGE3_OPTIMIZER),
        (dict(stage=1, dtype="bf16"), accum, BF16_OPTIMIZER),
        (dict(stage=2, dtype="bf16"), accum, ZERO_OPTIMIZER),
        (dict(stage=1, dtype="fp16"), accum, ZERO_OPTIMIZER),
        (dict(stage=1, dtype="bf16"), offload, ZERO_OPTIMIZER),
        (dict(stage=1, dtype="bf16"), None, ZERO_OPTIMIZER),
    ]
    for options, config, wrapper in cases:
        target = native_target(manifest, world_size=4, ds_config=config, **options)  # type: ignore[arg-type]
        assert target.wrapper == wrapper, (options, config)


def test_target_config_is_the_sources_with_stage_and_dtype_set() -> None:
    source = {"zero_optimization": {"stage": 2, "sub_group_size": 12}, "fp16": {"enabled": True,
              "initial_scale_power": 8}, "gradient_clipping": 0.5}  # fmt: skip
    manifest = make_manifest(dtype="float16", ds_config=source)
    same = native_target(manifest, world_size=3, stage=3)
    assert same.dtype == "float16" and same.sub_group_size == 12 and same.clip_grad == 0.5
    assert same.ds_config["zero_optimization"]["stage"] == 3
    assert same.ds_config["fp16"] == {"enabled": True, "initial_scale_power": 8}
    bf16 = native_target(manifest, world_size=3, stage=1, dtype="bf16", tag="t1")
    assert bf16.ds_config["fp16"]["enabled"] is False and bf16.ds_config["bf16"]["enabled"]
    assert bf16.file_prefix == "bf16_" and bf16.tag == "t1"
    assert source["zero_optimization"]["stage"] == 2  # the caller's dict is not modified
    plain = native_target(make_manifest(ds_config={}), world_size=2, stage=2)
    assert plain.clip_grad == 1.0 and plain.sub_group_size == 1_000_000_000


@pytest.mark.parametrize(
    ("options", "config", "message"),
    [
        (dict(stage=4), None, "ZeRO stage 4 is not a native export target; expected 1, 2 or 3."),
        (dict(stage=0), None, "ZeRO stage 0 is not a native export target"),
        (dict(stage=2, world_size=0), None, "world size must be at least 1, got 0."),
        (dict(stage=2), {"zero_optimization": {"round_robin_gradients": True}},
         "round_robin_gradients"),
        (dict(stage=3), {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
         "NVMe"),
    ],
)  # fmt: skip
def test_target_refusals(options: dict[str, Any], config: Any, message: str) -> None:
    kwargs = {"world_size": 2, **options}
    with pytest.raises(UnsupportedExportError, match=message.replace(".", r"\.")):
        native_target(make_manifest(), ds_config=config, **kwargs)


def test_zero12_plan_is_the_partition_math() -> None:
    manifest = make_manifest()
    plan = plan_native(manifest, native_target(manifest, world_size=4, stage=1))
    group1 = plan.flat_groups[1].layout
    assert isinstance(group1, PartitionedFlatLayout)
    assert (group1.total, group1.partition_size) == (24, 6)  # reference §4.4 example B
    assert list(group1.fragments(3)) == []  # rank 3 holds only padding
    assert plan.files == (
        "global_step4/mp_rank_00_model_states.pt",
        *(f"global_step4/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)),
        "latest",
    )
    assert plan.nbytes == (16 + 6) * 4 * 4 * 2  # ranks x (fp32 + exp_avg)


def test_parameter_alignment_pads_like_deepspeed() -> None:
    config = {"zero_optimization": {"stage": 2, "parameter_alignment": True}}
    manifest = make_manifest(dtype="bfloat16", ds_config=config)
    plan = plan_native(manifest, native_target(manifest, world_size=2, stage=2))
    assert [g.paddings for g in plan.flat_groups] == [(4, 1, 0), (3, 5, 5, 5, 0)]  # §4.5


def test_zero3_sub_groups_depend_on_world_size() -> None:
    config = {"zero_optimization": {"stage": 3, "sub_group_size": 12}}
    manifest = make_manifest(ds_config=config, frozen=(("frozen.weight", [3]),))
    two = plan_native(manifest, native_target(manifest, world_size=2, stage=3))
    assert [g.members for g in two.flat_groups] == [
        ("c.weight", "b.weight"), ("a.weight",), tuple(n for n, _ in MULTI[1]),
    ]  # fmt: skip
    assert [g.group for g in two.flat_groups] == [0, 0, 1]
    three = plan_native(manifest, native_target(manifest, world_size=3, stage=3, dtype="bf16"))
    assert len(three.flat_groups) == 2 and three.frozen == ("frozen.weight",)
    assert "global_step4/zero_pp_rank_2_mp_rank_00_model_states.pt" in three.files
    assert "global_step4/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt" in three.files


def test_native_plan_refuses_what_the_store_cannot_fill() -> None:
    bare = make_manifest(optimizer=False)
    with pytest.raises(UnsupportedExportError, match="writes optimizer state, but this store"):
        plan_native(bare, native_target(bare, world_size=2, stage=1))
    mixed = make_manifest(steps={"a.bias": 3})
    with pytest.raises(UnsupportedExportError, match=r"different optimizer steps \(\[3, 4\]\)"):
        plan_native(mixed, native_target(mixed, world_size=2, stage=1))


def test_universal_plan_lists_deepspeeds_layout() -> None:
    tag, files, payload = plan_deepspeed_universal(make_manifest())
    assert tag == "global_step4_universal"
    assert files[:3] == [
        f"{tag}/mp_rank_00_model_states.pt",
        f"{tag}/zero_pp_rank_0_mp_rank_00_model_states.pt",
        f"{tag}/zero/optimizer_state.pt",
    ]
    assert f"{tag}/zero/c.weight/fp32.pt" in files and f"{tag}/zero/c.weight/step.pt" in files
    assert files[-1] == "latest_universal" and payload == 80 * 4 * 2


def test_importing_exports_imports_no_deepspeed() -> None:
    code = (
        "import sys, ucformat; ucformat.export; ucformat.torch; "
        "assert 'deepspeed' not in sys.modules, 'deepspeed imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
