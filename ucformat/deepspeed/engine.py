"""Look inside a live DeepSpeed engine: its flat partitions, and how to write into them.

Supports the three ZeRO optimizer wrappers of DeepSpeed 0.19 (``DeepSpeedZeroOptimizer``,
``BF16_Optimizer``, ``DeepSpeedZeroOptimizer_Stage3``). The partition *ranges* are computed by
:mod:`ucformat.layout.partition` from the engine's parameter order and world size; the engine's
own buffer lengths are only used to cross-check them.

One state of a flat partition is not elementwise in it: DeepSpeed's Muon (``MuonWithAuxAdam``)
at ZeRO-1/2 keeps a Muon group's ``momentum_buffer`` as one whole copy of every parameter the
rank's partition touches, end to end in flat order (Muon orthogonalizes whole matrices). The view
names such keys per target (:attr:`EngineView.whole_copies`); the loader fills them from each
touched parameter's whole array (:mod:`ucformat.deepspeed.odd_states`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ucformat.deepspeed.experts import global_names
from ucformat.errors import LayoutMismatchError, UnsupportedCheckpointError
from ucformat.format.models import LossScaler
from ucformat.format.pyvalue import decode
from ucformat.layout.partition import PartitionedFlatLayout, PerParamLayout
from ucformat.layout.tensor_parallel import ShardMap
from ucformat.read.partitions import FlatTarget

__all__ = ["EngineView", "describe_engine", "engine_names", "name_of", "restore_loss_scaler"]

#: The state DeepSpeed's Muon keeps per ZeRO-1/2 partition as whole copies of the parameters
#: the partition touches.
MUON_BUFFER = "momentum_buffer"

#: Attributes DeepSpeed's ZeRO loss scalers (``DynamicLossScaler``) and the ZeRO-0 fp16
#: wrappers' ``LossScaleConfig`` both have, with the same meaning.
SHARED_SCALE_ATTRIBUTES = (
    "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window",
)  # fmt: skip


@dataclass
class EngineView:
    """What ucformat needs to know about, and do to, a DeepSpeed engine."""

    engine: Any
    wrapper: Any
    kind: str
    stage: int
    targets: list[FlatTarget]
    #: The live fp32 partition of each target (same order).
    fp32: list[torch.Tensor]
    #: id(param) -> fqn (owner names; tied aliases resolve to their owner; MoE experts under
    #: their global ids: ucformat.deepspeed.experts).
    names: dict[int, str]
    #: AutoTP: per fqn, this rank's shard of the full parameter (None: no tensor parallelism).
    shard_maps: dict[str, ShardMap] | None = None
    #: Per target index: optimizer state keys the target keeps as whole copies of the
    #: parameters its partition touches, end to end (DeepSpeed's Muon at ZeRO-1/2).
    whole_copies: dict[int, frozenset[str]] = field(default_factory=dict)

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The module's parameters under the names the store uses."""
        return [(self.names[id(p)], p) for _, p in self.engine.module.named_parameters()]

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer holding state and param groups."""
        optimizer: torch.optim.Optimizer = self.wrapper.optimizer
        return optimizer

    def state_key(self, index: int) -> torch.Tensor:
        """The tensor the base optimizer keys target ``index``'s state by."""
        return self.fp32[index]

    def sync_low_precision(self) -> None:
        """Copy fp32 partitions into the training-dtype weights (ZeRO-1/2: and all-gather)."""
        if self.kind == "zero3":
            wrapper = self.wrapper
            for sub_group, fp32 in enumerate(self.fp32):
                if fp32.numel() == 0:
                    continue
                flat = wrapper.fp16_partitioned_groups_flat[sub_group]
                flat.data.copy_(fp32.data)
                pieces = wrapper.fp16_partitioned_groups[sub_group]
                for piece, updated in zip(pieces, wrapper.unflatten(flat, pieces), strict=True):
                    piece.data = updated.data
            return
        self.wrapper.update_lp_params()

    def release_gathered(self) -> None:
        """ZeRO-3: release every gathered parameter before writing partitions.

        A parameter gathered whole on this rank (the persistent ones, ``ds_persist``: at most
        ``stage3_param_persistence_threshold`` elements, kept whole after each step; or any
        parameter a forward left gathered) would otherwise keep its old full copy next to the
        new partition. DeepSpeed's ``load_checkpoint`` starts the same way (the optimizer's
        ``checkpoint_event_prologue``). No communication.
        """
        prologue = getattr(self.wrapper, "checkpoint_event_prologue", None)
        if self.kind == "zero3" and prologue is not None:
            prologue()

    def regather_persistent(self) -> None:
        """ZeRO-3: gather the persistent parameters from the new partitions (collective).

        After DeepSpeed's own load (``checkpoint_event_epilogue``) and after every optimizer
        step, parameters ZeRO-3 keeps whole hold their full values in ``param.data``; so they
        do after ucformat's load. Stale secondary (hpZ) copies are dropped, as DeepSpeed does.
        """
        epilogue = getattr(self.wrapper, "checkpoint_event_epilogue", None)
        if self.kind == "zero3" and epilogue is not None:
            epilogue()

    def holds_whole_params(self) -> bool:
        """Whether each flat target is one parameter the optimizer steps whole (ZeRO-0 without
        a fused flat group); ZeRO partitions never are."""
        return False

    def scaler(self) -> Any:
        """The wrapper's loss scaler (``LossScaler`` / ``DynamicLossScaler``); None without one
        (``BF16_Optimizer``)."""
        return getattr(self.wrapper, "loss_scaler", None)

    def relink_optimizer_state(self) -> None:
        """Point DeepSpeed's per-param fragment views at the newly loaded optimizer state."""
        if self.kind in ("zero12", "bf16") and hasattr(self.wrapper, "_hp_optimizer_states_linked"):
            self.wrapper._hp_optimizer_states_linked = False
            self.wrapper._lazy_init_hp_params_optimizer_state()


def restore_loss_scaler(scaler: Any, saved: LossScaler) -> str | None:
    """Write the stored loss-scaler state into the live ``scaler``; what was restored, or None.

    The same class takes every stored attribute it has. A ZeRO scaler and a ZeRO-0 wrapper's
    ``LossScaleConfig`` (a stage change) exchange :data:`SHARED_SCALE_ATTRIBUTES` when both
    scale dynamically or both do not; otherwise nothing is written (None).
    """
    if type(scaler).__name__ == saved.class_name:
        for name, value in saved.attributes.items():
            if name in vars(scaler):
                setattr(scaler, name, decode(value))
        return saved.class_name
    live = vars(scaler)
    dynamic = bool(live.get("dynamic", live.get("dynamic_loss_scale", False)))
    if dynamic != saved.dynamic:
        return None
    stored = {name: decode(value) for name, value in saved.attributes.items()}
    for name in SHARED_SCALE_ATTRIBUTES:
        if name in stored and name in live:
            setattr(scaler, name, stored[name])
    return f"{saved.class_name} into {type(scaler).__name__}"


def engine_names(engine: Any, renames: Mapping[str, str] | None = None) -> dict[int, str]:
    """``id(param) -> fqn`` of ``engine.module``: MoE experts under their global ids
    (:mod:`ucformat.deepspeed.experts`), then ``renames`` applied (the names a store keeps
    some parameters under: :func:`ucformat.deepspeed.pipeline.tied_store_names`)."""
    if getattr(engine, "has_moe_layers", False):
        names = global_names(engine)
    else:
        names = {id(p): name for name, p in engine.module.named_parameters()}
    if renames:
        names = {key: renames.get(name, name) for key, name in names.items()}
    return names


def _group_rank(group: Any) -> tuple[int, int]:
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def describe_engine(engine: Any, renames: Mapping[str, str] | None = None) -> EngineView:
    """Build the :class:`EngineView` of ``engine`` (``renames``: :func:`engine_names`).

    Raises:
        UnsupportedCheckpointError: no ZeRO optimizer, MoE, or NVMe offload.
        LayoutMismatchError: ucformat's partition math disagrees with the engine's buffers.
    """
    wrapper = getattr(engine, "optimizer", None)
    kind = type(wrapper).__name__
    names = engine_names(engine, renames)
    if kind == "DeepSpeedZeroOptimizer":
        return _zero12(engine, wrapper, names)
    if kind == "BF16_Optimizer":
        return _bf16(engine, wrapper, names)
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        return _zero3(engine, wrapper, names)
    raise UnsupportedCheckpointError(
        f"engine optimizer is {kind}; ucformat loads into ZeRO stage 1, 2 or 3 engines "
        "(DeepSpeedZeroOptimizer, BF16_Optimizer, DeepSpeedZeroOptimizer_Stage3)."
    )


def name_of(names: dict[int, str], param: torch.Tensor) -> str:
    """The store name of ``param`` (an engine optimizer parameter must be in ``engine.module``)."""
    name = names.get(id(param))
    if name is None:
        raise UnsupportedCheckpointError(
            "the engine's optimizer holds a parameter that is not in engine.module; ucformat "
            "matches parameters by name and cannot load it."
        )
    return name


def _check_length(kind: str, index: int, computed: int, actual: int) -> None:
    if computed != actual:
        raise LayoutMismatchError(
            f"{kind} flat group {index}: the engine's fp32 partition has {actual} elements but "
            f"ucformat computes {computed} from the parameter order and world size; this "
            "DeepSpeed version partitions differently and is not supported."
        )


def _zero12(engine: Any, wrapper: Any, names: dict[int, str]) -> EngineView:
    targets: list[FlatTarget] = []
    fp32: list[torch.Tensor] = []
    for index, params in enumerate(wrapper.round_robin_bit16_groups):
        rank, world = _group_rank(wrapper.real_dp_process_group[index])
        members = [(name_of(names, p), p.numel()) for p in params]
        pads = list(wrapper.round_robin_bit16_padding[index])
        layout = PartitionedFlatLayout.build(members, world, pads)
        partition = wrapper.single_partition_of_fp32_groups[index]
        _check_length("ZeRO-1/2", index, layout.partition_size, partition.numel())
        targets.append(FlatTarget(index, index, layout, rank, partition.numel()))
        fp32.append(partition)
    stage = int(engine.zero_optimization_stage())
    muon = {
        index: frozenset({MUON_BUFFER})
        for index, params in enumerate(wrapper.round_robin_bit16_groups)
        if _steps_by_muon(wrapper, params)
    }
    return EngineView(engine, wrapper, "zero12", stage, targets, fp32, names, whole_copies=muon)


def _steps_by_muon(wrapper: Any, params: list[torch.nn.Parameter]) -> bool:
    """Whether DeepSpeed's Muon steps this flat group (DeepSpeed's own test: a Muon optimizer,
    and the group's parameters tagged ``use_muon``)."""
    muon = "muon" in type(wrapper.optimizer).__name__.lower()
    return muon and bool(params) and bool(getattr(params[0], "use_muon", False))


def _bf16(engine: Any, wrapper: Any, names: dict[int, str]) -> EngineView:
    targets: list[FlatTarget] = []
    fp32: list[torch.Tensor] = []
    for index, params in enumerate(wrapper.bf16_groups):
        rank, world = _group_rank(wrapper.real_dp_process_group[index])
        layout = PartitionedFlatLayout.build(
            [(name_of(names, p), p.numel()) for p in params], world
        )
        partition = wrapper.fp32_groups_flat_partition[index]
        _check_length("BF16_Optimizer", index, layout.partition_size, partition.numel())
        targets.append(FlatTarget(index, index, layout, rank, partition.numel()))
        fp32.append(partition)
    return EngineView(engine, wrapper, "bf16", 1, targets, fp32, names)


def _zero3(engine: Any, wrapper: Any, names: dict[int, str]) -> EngineView:
    if getattr(wrapper, "swap_optimizer", False) or getattr(wrapper, "offload_param", False):
        raise UnsupportedCheckpointError(
            "ZeRO-3 with NVMe optimizer swapping or parameter offload is not supported by "
            "ucformat's loader yet."
        )
    targets: list[FlatTarget] = []
    fp32: list[torch.Tensor] = []
    for index, params in enumerate(wrapper.fp16_groups):
        rank, world = _group_rank(wrapper._get_param_partition_group(params[0]))
        layout = PerParamLayout.build([(name_of(names, p), p.ds_numel) for p in params], world)
        for slot, param in zip(layout.slots, params, strict=True):
            if layout.piece_size(slot.numel) != param.ds_tensor.ds_numel:
                raise LayoutMismatchError(
                    f"ZeRO-3 param '{slot.name}': the engine's partition holds "
                    f"{param.ds_tensor.ds_numel} elements but ucformat computes "
                    f"{layout.piece_size(slot.numel)}; not supported."
                )
        partition = wrapper.fp32_partitioned_groups_flat[index]
        _check_length("ZeRO-3", index, layout.partition_size, partition.numel())
        group = int(wrapper.sub_group_to_group_id[index])
        targets.append(FlatTarget(index, group, layout, rank, partition.numel()))
        fp32.append(partition)
    return EngineView(engine, wrapper, "zero3", 3, targets, fp32, names)
