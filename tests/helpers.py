"""Small builders shared by tests (no files, no torch.distributed)."""

from __future__ import annotations

from ucformat.format.models import (
    ArrayRef,
    CheckpointManifest,
    OptimizerGroup,
    OptimizerInfo,
    ParamEntry,
    ScalarState,
    SourceInfo,
)


def array_ref(path: str, shape: list[int], dtype: str = "float32") -> ArrayRef:
    numel = 1
    for dim in shape:
        numel *= dim
    return ArrayRef(
        path=path,
        dtype=dtype,
        shape=shape,
        chunk_shape=shape or [],
        shard_shape=shape or [],  # type: ignore[arg-type]
        nbytes=numel * 4,
    )


def source_info(**overrides: object) -> SourceInfo:
    """A valid :class:`SourceInfo` (ZeRO-1, world size 2, bf16) with ``overrides`` applied."""
    fields: dict[str, object] = {
        "framework_version": "0.19.8",
        "path": "/x",
        "tag": "t",
        "zero_stage": 1,
        "world_size": 2,
        "train_dtype": "bfloat16",
        "optimizer_wrapper": "DeepSpeedZeroOptimizer",
        "files": [],
    }
    return SourceInfo.model_validate({**fields, **overrides})


def tiny_manifest() -> CheckpointManifest:
    """A valid two-param manifest with one tied alias."""
    params = {
        name: ParamEntry(
            shape=shape,
            dtype="bfloat16",
            requires_grad=True,
            group=0,
            states={s: array_ref(f"params/{name}/{s}", shape) for s in ("fp32", "exp_avg")},
            scalars={"step": ScalarState(kind="int", value=4)},
        )
        for name, shape in (("emb.weight", [4, 3]), ("head.bias", [4]))
    }
    return CheckpointManifest(
        created_by="tests",
        source=source_info(),
        params=params,
        tied={"lm_head.weight": "emb.weight"},
        optimizer=OptimizerInfo(
            name="deepspeed.ops.adam.FusedAdam",
            state_keys=["exp_avg"],
            scalar_keys=["step"],
            groups=[OptimizerGroup(params=list(params), hyperparams={"lr": 0.001})],
        ),
    )
