"""The target of a native DeepSpeed export, and its plan: pure, from the manifest alone.

The target (world size, ZeRO stage, training dtype, DeepSpeed config) decides which optimizer
wrapper DeepSpeed 0.19.8 would build, and so which files and layouts a stock
``engine.load_checkpoint`` expects:

* ZeRO-3: ``DeepSpeedZeroOptimizer_Stage3``; each optimizer group is cut into sub-groups of
  about ``zero_optimization.sub_group_size`` elements per rank (default 1e9), each parameter
  partitioned on its own (:class:`~ucformat.layout.partition.PerParamLayout`).
* ZeRO-1 with bf16 and ``data_types.grad_accum_dtype`` fp32 (no CPU offload):
  ``BF16_Optimizer``.
* otherwise ZeRO-1/2: ``DeepSpeedZeroOptimizer``, one flat buffer per optimizer group padded to
  ``2 * world_size`` (:class:`~ucformat.layout.partition.PartitionedFlatLayout`), with
  ``parameter_alignment`` zeros when the config asks for them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from ucformat.errors import UnsupportedExportError
from ucformat.export.common import parse_dtype
from ucformat.export.deepspeed_common import flat_group_step, frozen_names, require_optimizer
from ucformat.format.dtypes import itemsize
from ucformat.format.models import CheckpointManifest
from ucformat.format.pyvalue import decode
from ucformat.layout.partition import (
    PartitionedFlatLayout,
    PerParamLayout,
    alignment_paddings,
    zero3_sub_groups,
)
from ucformat.sources.deepspeed.files import (
    BF16_PREFIX,
    LATEST_FILE,
    model_states_file,
    optim_states_file,
)

__all__ = [
    "BF16_OPTIMIZER",
    "DEFAULT_SUB_GROUP_SIZE",
    "STAGE3_OPTIMIZER",
    "ZERO_OPTIMIZER",
    "FlatGroup",
    "NativePlan",
    "NativeTarget",
    "native_target",
    "plan_native",
    "resolve_auto",
]

ZERO_OPTIMIZER = "DeepSpeedZeroOptimizer"
BF16_OPTIMIZER = "BF16_Optimizer"
STAGE3_OPTIMIZER = "DeepSpeedZeroOptimizer_Stage3"
#: DeepSpeed's default ``zero_optimization.sub_group_size``.
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
#: DeepSpeed's default ``gradient_clipping``.
DEFAULT_GRADIENT_CLIPPING = 1.0
_FP32_NAMES = frozenset({"fp32", "float32", "float", "torch.float32"})


@dataclass(frozen=True)
class NativeTarget:
    """The job that will load the export: its world size, stage, dtype and config."""

    world_size: int
    stage: int
    dtype: str
    wrapper: str
    sub_group_size: int
    parameter_alignment: bool
    clip_grad: float
    ds_config: dict[str, Any]
    tag: str

    @property
    def file_prefix(self) -> str:
        """``bf16_`` when bf16 is enabled (whatever the stage), else empty."""
        return BF16_PREFIX if self.dtype == "bfloat16" else ""

    def optim_file(self, rank: int) -> str:
        """Optimizer-states file name of data-parallel ``rank``."""
        return optim_states_file(rank, self.file_prefix)

    def model_file(self, rank: int) -> str:
        """Model-states file name (ZeRO-1/2: one file; ZeRO-3: one per rank)."""
        return model_states_file(rank if self.stage == 3 else None)


@dataclass(frozen=True)
class FlatGroup:
    """One flat buffer of the target: a ZeRO-1/2 param group or a ZeRO-3 sub-group."""

    index: int
    group: int
    members: tuple[str, ...]
    layout: PartitionedFlatLayout | PerParamLayout
    #: ZeRO-1/2 ``param_alignment_paddings`` of this group (zeros unless alignment is on).
    paddings: tuple[int, ...]


@dataclass(frozen=True)
class NativePlan:
    """Everything a native export writes, decided before any tensor is read."""

    target: NativeTarget
    flat_groups: tuple[FlatGroup, ...]
    frozen: tuple[str, ...]
    files: tuple[str, ...]
    nbytes: int


def _source_config(manifest: CheckpointManifest) -> dict[str, Any]:
    config = decode(manifest.source.ds_config) if manifest.source.ds_config is not None else {}
    return copy.deepcopy(config) if isinstance(config, dict) else {}


def resolve_auto(config: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    """``config`` with every ``"auto"`` value (Hugging Face's placeholder) resolved.

    An ``"auto"`` takes the value at the same place in ``source`` (the config DeepSpeed ran
    with, in which the Trainer had filled them in); one the source does not have is dropped,
    so that DeepSpeed's default applies, as it would to a key never written.
    """
    out: dict[str, Any] = {}
    for key, value in config.items():
        known = source.get(key) if isinstance(source, dict) else None
        if isinstance(value, dict):
            out[key] = resolve_auto(value, known if isinstance(known, dict) else {})
        elif value == "auto":
            if known is not None and known != "auto" and not isinstance(known, dict):
                out[key] = copy.deepcopy(known)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _config_dtype(config: dict[str, Any]) -> str | None:
    for key, name in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled"):
            return name
    return None


def _set_dtype(config: dict[str, Any], dtype: str) -> None:
    wanted = {"bfloat16": ("bf16",), "float16": ("fp16",), "float32": ()}[dtype]
    for key in ("bf16", "bfloat16", "fp16"):
        section = config.get(key)
        if isinstance(section, dict) and key not in wanted:
            config[key] = {**section, "enabled": False}
    for key in wanted:
        alias = "bfloat16" if key == "bf16" and "bfloat16" in config else key
        section = config.get(alias)
        config[alias] = {**(section if isinstance(section, dict) else {}), "enabled": True}


def _wrapper(stage: int, dtype: str, config: dict[str, Any]) -> str:
    if stage == 3:
        return STAGE3_OPTIMIZER
    zero = config.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    offload = offload or bool(zero.get("cpu_offload"))
    accum = (config.get("data_types") or {}).get("grad_accum_dtype")
    if stage == 1 and dtype == "bfloat16" and str(accum) in _FP32_NAMES and not offload:
        return BF16_OPTIMIZER
    return ZERO_OPTIMIZER


def native_target(
    manifest: CheckpointManifest,
    *,
    world_size: int,
    stage: int,
    dtype: str | None = None,
    ds_config: dict[str, Any] | None = None,
    tag: str | None = None,
) -> NativeTarget:
    """Describe the target job.

    Args:
        manifest: the store's manifest.
        world_size: data-parallel ranks that will load the export.
        stage: ZeRO stage 1, 2 or 3.
        dtype: training dtype (``fp32``/``fp16``/``bf16``); default: the config's, else the
            source's.
        ds_config: the DeepSpeed config the target job uses (default: the source's config).
            Its ``zero_optimization.stage`` and precision sections are set to match
            ``stage`` and ``dtype``; it is written into the files as DeepSpeed does.
            ``"auto"`` values take the source config's (:func:`resolve_auto`).
        tag: checkpoint tag (default: the source's tag).
    """
    if stage not in (1, 2, 3):
        raise UnsupportedExportError(
            f"ZeRO stage {stage} is not a native export target; expected 1, 2 or 3."
        )
    if world_size < 1:
        raise UnsupportedExportError(f"world size must be at least 1, got {world_size}.")
    source = _source_config(manifest)
    config = resolve_auto(ds_config, source) if ds_config is not None else source
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = stage
    config["zero_optimization"] = zero
    chosen = parse_dtype(dtype)
    if chosen is None:
        chosen = _config_dtype(config) or (
            manifest.source.train_dtype if ds_config is None else "float32"
        )
    _set_dtype(config, chosen)
    if stage in (1, 2) and zero.get("round_robin_gradients"):
        raise UnsupportedExportError(
            "the target config sets zero_optimization.round_robin_gradients, whose ZeRO-1/2 "
            "files DeepSpeed itself maps wrongly; remove it from the config (--config) to export."
        )
    for key in ("offload_optimizer", "offload_param"):
        if (zero.get(key) or {}).get("device") == "nvme":
            raise UnsupportedExportError(
                f"the target config offloads to NVMe (zero_optimization.{key}); NVMe swap "
                "files are not written by this export. Use device 'cpu' or none."
            )
    sub_group_size = int(zero.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE))
    if sub_group_size < 1:
        raise UnsupportedExportError(f"sub_group_size must be positive, got {sub_group_size}.")
    return NativeTarget(
        world_size=world_size,
        stage=stage,
        dtype=chosen,
        wrapper=_wrapper(stage, chosen, config),
        sub_group_size=sub_group_size,
        parameter_alignment=bool(zero.get("parameter_alignment", False)) and stage in (1, 2),
        clip_grad=float(config.get("gradient_clipping", DEFAULT_GRADIENT_CLIPPING)),
        ds_config=config,
        tag=tag or manifest.source.tag,
    )


def _flat_groups(manifest: CheckpointManifest, target: NativeTarget) -> list[FlatGroup]:
    assert manifest.optimizer is not None  # checked by require_optimizer
    flat: list[FlatGroup] = []
    for group, entry in enumerate(manifest.optimizer.groups):
        members = [(name, manifest.params[name].numel) for name in entry.params]
        if target.stage == 3:
            for names in zero3_sub_groups(members, target.world_size, target.sub_group_size):
                sub = [(n, manifest.params[n].numel) for n in names]
                layout = PerParamLayout.build(sub, target.world_size)
                flat.append(FlatGroup(len(flat), group, tuple(names), layout, (0,) * len(names)))
            continue
        numels = [numel for _, numel in members]
        aligned = target.parameter_alignment and target.wrapper == ZERO_OPTIMIZER
        zeros = [0] * len(numels)
        aligns = alignment_paddings(numels, itemsize(target.dtype)) if aligned else zeros
        layout2 = PartitionedFlatLayout.build(members, target.world_size, aligns)
        flat.append(FlatGroup(group, group, tuple(entry.params), layout2, tuple(aligns)))
    return flat


def _payload(plan_groups: list[FlatGroup], target: NativeTarget, states: int) -> int:
    per_rank = sum(g.layout.partition_size for g in plan_groups)
    return per_rank * target.world_size * 4 * (1 + states)


def plan_native(manifest: CheckpointManifest, target: NativeTarget) -> NativePlan:
    """Plan a native export: flat groups, file names and payload; refuse what cannot be filled.

    Raises:
        UnsupportedExportError: no optimizer state, or one flat group would hold parameters
            saved at different steps.
    """
    require_optimizer(manifest, "deepspeed")
    assert manifest.optimizer is not None
    groups = _flat_groups(manifest, target)
    for flat in groups:
        flat_group_step(manifest, flat.members, f"flat group {flat.index}")
    ranks = range(target.world_size)
    models = [target.model_file(r) for r in (ranks if target.stage == 3 else [0])]
    files = [f"{target.tag}/{name}" for name in models]
    files += [f"{target.tag}/{target.optim_file(r)}" for r in ranks]
    files.append(LATEST_FILE)
    payload = _payload(groups, target, len(manifest.optimizer.state_keys))
    return NativePlan(target, tuple(groups), tuple(frozen_names(manifest)), tuple(files), payload)
