"""``ucformat export deepspeed`` of an MoE store: native DeepSpeed MoE files at a new ep / dp.

The output is what DeepSpeed 0.19.8 writes from ``engine.save_checkpoint(out, tag)`` in a job of
``world_size`` ranks whose native MoE layers (``deepspeed.moe.layer.MoE``) run at ``ep_size``,
ZeRO stage 0, 1 or 2, fp32, so that a stock ``engine.load_checkpoint(out)`` there restores
weights, fp32 masters, Adam moments and step:

* ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt``: MoE layer ``L``'s global expert ``E``,
  keyed by its global name (DeepSpeed renames the id to the local one on load);
* ``mp_rank_00_model_states.pt``: the dense parameters and buffers (``module``), ``param_shapes``
  of EP rank 0's two flat groups, ``num_experts`` per MoE layer, counters, config;
* ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per rank ``r``: group 0 (dense) is rank
  ``r``'s ZeRO partition over all ``world_size`` ranks; group 1 (experts, named
  ``ep_size_<ep>``) holds the experts of ``r``'s EP rank (``r mod ep_size``: DeepSpeed's default
  rank order), partitioned over its ``world_size / ep_size`` expert-data-parallel ranks, under
  their *local* names, as DeepSpeed keeps them (ZeRO-1/2, ``DeepSpeedZeroOptimizer``);
* ZeRO-0 instead: ``expp_rank_{e}_mp_rank_00_optim_states.pt`` per EP rank ``e``, the torch
  optimizer's ``state_dict()`` of a rank with EP rank ``e`` (dense parameters, then ``e``'s
  experts; param-shaped states), also stored as ``optimizer`` in the model states (EP rank 0's).

Each file is built from exactly the ranges it holds (:mod:`ucformat.layout.partition`, the
layout math the dense export uses); ``latest`` is written last.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ucformat.errors import LayoutMismatchError, UnsupportedExportError
from ucformat.export.common import (
    ExportHooks,
    ExportResult,
    Stopwatch,
    open_store_arg,
)
from ucformat.export.deepspeed_common import (
    DeepSpeedClasses,
    build_loss_scaler,
    flat_group_step,
    model_states,
    module_state_dict,
)
from ucformat.export.destination import save_torch
from ucformat.export.native_export import NativeExport, run_native_export
from ucformat.export.native_target import ZERO_OPTIMIZER, NativeTarget, native_target
from ucformat.export.url_target import is_url
from ucformat.format.models import CheckpointManifest
from ucformat.format.pyvalue import decode
from ucformat.format.spec import FP32_STATE
from ucformat.layout.experts import ExpertRanks, expert_id, with_expert_id
from ucformat.layout.partition import PartitionedFlatLayout
from ucformat.read.checkpoint import UniversalCheckpoint
from ucformat.sources.deepspeed.files import LATEST_FILE
from ucformat.store.keys import StoreLike

__all__ = ["ExpertsPlan", "export_deepspeed_experts", "plan_deepspeed_experts"]


@dataclass(frozen=True)
class ExpertsPlan:
    """Everything an MoE native export writes, decided from the manifest alone."""

    target: NativeTarget
    ranks: ExpertRanks
    #: The dense optimizer group's parameters, in flat order (the store's group order).
    dense: tuple[str, ...]
    dense_layout: PartitionedFlatLayout
    #: Per EP rank: its expert parameters under their global names, in flat (module) order.
    experts: tuple[tuple[str, ...], ...]
    #: Per EP rank: the layout of those over the expert-data-parallel ranks.
    expert_layouts: tuple[PartitionedFlatLayout, ...]
    #: (dense group index, expert group index) in the store's optimizer groups.
    groups: tuple[int, int]
    files: tuple[str, ...]
    nbytes: int

    def local_name(self, name: str) -> str:
        """An expert parameter's name on its EP rank (local id), as DeepSpeed's files key it."""
        parts = expert_id(name)
        return name if parts is None else with_expert_id(name, parts[1] % self.ranks.num_local)


def expp_file(ep_rank: int) -> str:
    """ZeRO-0 MoE optimizer-states file of EP rank ``ep_rank``."""
    return f"expp_rank_{ep_rank}_mp_rank_00_optim_states.pt"


def _refuse(what: str) -> UnsupportedExportError:
    return UnsupportedExportError(f"'export deepspeed' of an MoE store: {what}")


def _num_experts(manifest: CheckpointManifest) -> int:
    assert manifest.experts is not None
    counts = {layer.num_experts for layer in manifest.experts.layers}
    if len(counts) != 1:
        raise _refuse(f"MoE layers with different numbers of experts ({sorted(counts)}).")
    return counts.pop()


def _groups(manifest: CheckpointManifest, experts: set[str]) -> tuple[int, int]:
    optimizer = manifest.optimizer
    if optimizer is None or len(optimizer.groups) != 2:
        found = 0 if optimizer is None else len(optimizer.groups)
        raise _refuse(
            f"expected two optimizer param groups (dense, experts), found {found}; re-convert "
            "the run's checkpoint with its optimizer shards."
        )
    kinds = [{name in experts for name in g.params} for g in optimizer.groups]
    if kinds == [{False}, {True}]:
        return 0, 1
    if kinds == [{True}, {False}]:
        return 1, 0
    raise _refuse("its optimizer groups mix expert and dense parameters.")


def plan_deepspeed_experts(
    manifest: CheckpointManifest,
    *,
    world_size: int,
    stage: int,
    ep_size: int,
    dtype: str | torch.dtype | None = None,
    ds_config: dict[str, Any] | None = None,
    tag: str | None = None,
) -> ExpertsPlan:
    """Plan an MoE native export from the manifest alone (see :func:`export_deepspeed_experts`).

    Raises:
        UnsupportedExportError: not an MoE store, a target the export does not write (ZeRO-0 or
            3, fp16/bf16, parameter alignment), or ``ep_size`` not dividing the world size or
            the experts.
    """
    if manifest.experts is None:
        raise _refuse("this store holds no MoE experts; use 'export deepspeed' without --ep-size.")
    if stage not in (0, 1, 2):
        raise _refuse(f"ZeRO stage {stage} targets are not written; expected 0, 1 or 2.")
    dtype_name = None if dtype is None else str(dtype).removeprefix("torch.")
    target = native_target(
        manifest, world_size=world_size, stage=max(stage, 1), dtype=dtype_name,
        ds_config=ds_config, tag=tag,
    )  # fmt: skip
    if stage == 0:  # no ZeRO wrapper: the torch optimizer's own state_dict
        config = {**target.ds_config, "zero_optimization": {"stage": 0}}
        target = replace(target, stage=0, ds_config=config)
    if target.dtype != "float32" or target.wrapper != ZERO_OPTIMIZER or target.parameter_alignment:
        raise _refuse(
            f"only fp32 DeepSpeedZeroOptimizer targets without parameter_alignment are written "
            f"(asked: {target.dtype}, {target.wrapper}); pass --dtype fp32."
        )
    if target.ds_config.get("use_data_before_expert_parallelism"):
        raise _refuse("the use_data_before_expert_parallelism rank order is not written.")
    frozen = [n for n, entry in manifest.params.items() if entry.group is None]
    if frozen:
        raise _refuse(f"frozen parameters ({frozen[0]}, ...) are not written.")
    try:
        ranks = ExpertRanks(world_size, ep_size, _num_experts(manifest))
    except LayoutMismatchError as exc:
        raise _refuse(str(exc)) from exc
    names = set(manifest.experts.param_names())
    dense_index, expert_index = _groups(manifest, names)
    assert manifest.optimizer is not None
    missing = [
        n
        for g in manifest.optimizer.groups
        for n in g.params
        if any(k not in manifest.params[n].states for k in manifest.optimizer.state_keys)
    ]
    if missing:
        raise _refuse(f"parameter '{missing[0]}' has no optimizer state in this store.")
    dense = tuple(manifest.optimizer.groups[dense_index].params)
    numel = {n: manifest.params[n].numel for n in manifest.params}
    dense_layout = PartitionedFlatLayout.build([(n, numel[n]) for n in dense], world_size)
    layers = sorted(manifest.experts.layers, key=lambda layer: layer.layer)
    experts: list[tuple[str, ...]] = []
    layouts: list[PartitionedFlatLayout] = []
    for ep_rank in range(ep_size):
        members = tuple(
            f"{layer.prefix}.{ranks.global_id(ep_rank, local)}.{param}"
            for layer in layers
            for local in range(ranks.num_local)
            for param in layer.params
        )
        experts.append(members)
        layouts.append(
            PartitionedFlatLayout.build([(n, numel[n]) for n in members], ranks.expert_dp_size)
        )
    for members in (dense, *experts):
        flat_group_step(manifest, members, "a flat group")
    expert_files = [
        f"layer_{i}_expert_{e}_mp_rank_00_model_states.pt"
        for i in range(len(layers))
        for e in range(ranks.num_experts)
    ]
    optim = [target.optim_file(r) for r in range(world_size)]
    if stage == 0:
        optim = [expp_file(e) for e in range(ep_size)]
    files = [f"{target.tag}/{n}" for n in (*expert_files, target.model_file(0), *optim)]
    per_rank = dense_layout.partition_size + layouts[0].partition_size
    states = 1 + len(manifest.optimizer.state_keys)
    return ExpertsPlan(
        target,
        ranks,
        dense,
        dense_layout,
        tuple(experts),
        tuple(layouts),
        (dense_index, expert_index),
        (*files, LATEST_FILE),
        per_rank * world_size * 4 * states,
    )


class _Files:
    """Builds each file's dict; one rank's partitions in memory at a time."""

    def __init__(
        self, ckpt: UniversalCheckpoint, plan: ExpertsPlan, classes: DeepSpeedClasses
    ) -> None:
        self.ckpt = ckpt
        self.plan = plan
        self.classes = classes
        manifest = ckpt.manifest
        assert manifest.optimizer is not None
        assert manifest.experts is not None
        self.state_keys = list(manifest.optimizer.state_keys)
        groups = manifest.optimizer.groups
        dense, experts = plan.groups
        self.hyper = [
            {k: decode(v) for k, v in groups[dense].hyperparams.items()},
            {k: decode(v) for k, v in groups[experts].hyperparams.items()},
        ]
        # the engine's own expert group name at the target ep_size
        self.hyper[1].update({"name": f"ep_size_{plan.ranks.ep_size}", "moe": True})
        self.scaler, self.dynamic = build_loss_scaler(
            self.classes, manifest, plan.target.dtype, plan.target.ds_config
        )

    def _flat(self, layout: PartitionedFlatLayout, rank: int, state: str) -> torch.Tensor:
        out = torch.zeros(layout.partition_size, dtype=torch.float32)
        for f in layout.fragments(rank):
            values = self.ckpt.read_range(f.name, state, f.param_start, f.param_stop)
            out[f.partition_start : f.partition_start + f.length].copy_(values)
        return out

    def optimizer_file(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s ``zero_pp_rank`` file (DeepSpeedZeroOptimizer.state_dict, rigid)."""
        plan, ranks = self.plan, self.plan.ranks
        ep_rank, edp_rank = ranks.ep_rank(rank), ranks.expert_dp_rank(rank)
        parts = [
            (plan.dense, plan.dense_layout, rank, False),
            (plan.experts[ep_rank], plan.expert_layouts[ep_rank], edp_rank, True),
        ]
        state: dict[int, dict[str, Any]] = {}
        fp32: list[torch.Tensor] = []
        paddings: list[int] = []
        mappings: list[OrderedDict[str, Any]] = []
        for index, (members, layout, part, local) in enumerate(parts):
            valid = layout.valid_length(part)
            fp32.append(self._flat(layout, part, FP32_STATE)[:valid].clone())
            paddings.append(layout.partition_size - valid)
            mappings.append(
                OrderedDict(
                    (
                        plan.local_name(f.name) if local else f.name,
                        self.classes.fragment_address(numel=f.length, start=f.partition_start),
                    )
                    for f in layout.fragments(part)
                )
            )
            entry: dict[str, Any] = {}
            step = flat_group_step(self.ckpt.manifest, members, "a flat group")
            if step is not None:
                entry["step"] = step
            for key in self.state_keys:
                entry[key] = self._flat(layout, part, key)
            state[index] = entry
        groups = [{**hp, "params": [i]} for i, hp in enumerate(self.hyper)]
        progress = self.ckpt.manifest.progress
        inner = {
            "loss_scaler": self.scaler,
            "dynamic_loss_scale": self.dynamic,
            "overflow": bool(progress.overflow),
            "clip_grad": plan.target.clip_grad,
            "base_optimizer_state": {"state": state, "param_groups": groups},
            "single_partition_of_fp32_groups": fp32,
            "zero_stage": self.classes.zero_stage(plan.target.stage),
            "group_paddings": paddings,
            "param_alignment_paddings": [[0] * len(plan.dense), [0] * len(plan.experts[ep_rank])],
            "partition_count": [ranks.world_size, ranks.expert_dp_size],
            "ds_version": self.classes.version,
            "param_slice_mappings": mappings,
        }
        return {
            "optimizer_state_dict": inner,
            "ds_config": plan.target.ds_config,
            "ds_version": self.classes.version,
        }

    def torch_optimizer(self, ep_rank: int) -> dict[str, Any]:
        """ZeRO-0: the torch optimizer ``state_dict()`` of a rank of EP rank ``ep_rank``."""
        plan, manifest = self.plan, self.ckpt.manifest
        members = [*plan.dense, *plan.experts[ep_rank]]
        state: dict[int, dict[str, Any]] = {}
        for index, name in enumerate(members):
            shape = torch.Size(manifest.params[name].shape)
            entry: dict[str, Any] = {}
            step = flat_group_step(manifest, [name], f"parameter '{name}'")
            if isinstance(step, torch.Tensor):
                entry["step"] = step
            elif step is not None:
                entry["step"] = torch.tensor(float(step))
            for key in self.state_keys:
                entry[key] = self.ckpt.read(name, key).float().reshape(shape)
            state[index] = entry
        split = len(plan.dense)
        groups = [
            {**self.hyper[0], "params": list(range(split))},
            {**self.hyper[1], "params": list(range(split, len(members)))},
        ]
        return {"state": state, "param_groups": groups}

    def model_file(self) -> dict[str, Any]:
        """``mp_rank_00_model_states.pt``: dense weights and buffers, no experts."""
        manifest, plan = self.ckpt.manifest, self.plan
        experts = set(name for members in plan.experts for name in members)
        module = module_state_dict(self.ckpt, "float32", placeholders=False)
        dense_module = OrderedDict((k, v) for k, v in module.items() if k not in experts)
        shapes = [
            OrderedDict((n, torch.Size(manifest.params[n].shape)) for n in plan.dense),
            OrderedDict(
                (plan.local_name(n), torch.Size(manifest.params[n].shape)) for n in plan.experts[0]
            ),
        ]
        state, _ = model_states(
            manifest,
            module=dense_module,
            param_shapes=shapes,
            frozen_shapes=None,
            frozen_fragments=None,
            shared_params=dict(manifest.tied),
            world_size=plan.ranks.world_size,
            ds_config=plan.target.ds_config,
            ds_version=self.classes.version,
        )
        assert manifest.experts is not None
        if plan.target.stage == 0:  # as DeepSpeed: EP rank 0's optimizer, no param_shapes
            state["optimizer"] = self.torch_optimizer(0)
            state["param_shapes"] = None
        state["num_experts"] = [layer.num_experts for layer in manifest.experts.layers]
        state["ds_autoep_layers"] = None
        return state

    def expert_file(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """One global expert's weights under its global names."""
        manifest = self.ckpt.manifest
        assert manifest.experts is not None
        entry = sorted(manifest.experts.layers, key=lambda e: e.layer)[layer]
        names = [f"{entry.prefix}.{expert}.{p}" for p in entry.params]
        return OrderedDict((n, self.ckpt.read(n, FP32_STATE).float()) for n in names)


def _write_files(
    ckpt: UniversalCheckpoint,
    plan: ExpertsPlan,
    classes: DeepSpeedClasses,
    tag_dir: Path,
    hooks: ExportHooks,
) -> list[str]:
    """Write the expert files, the model states, then the optimizer-states files; no notes."""
    files = _Files(ckpt, plan, classes)
    target, ranks = plan.target, plan.ranks
    assert ckpt.manifest.experts is not None
    for layer in range(len(ckpt.manifest.experts.layers)):
        for expert in range(ranks.num_experts):
            name = f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"
            save_torch(files.expert_file(layer, expert), tag_dir / name)
    save_torch(files.model_file(), tag_dir / target.model_file(0))
    for ep_rank in range(ranks.ep_size if target.stage == 0 else 0):
        optimizer = {"optimizer": files.torch_optimizer(ep_rank)}
        save_torch(optimizer, tag_dir / expp_file(ep_rank))
    for rank in range(ranks.world_size if target.stage else 0):
        save_torch(files.optimizer_file(rank), tag_dir / target.optim_file(rank))
        hooks.advance(plan.nbytes // ranks.world_size)
    return []


def _describe(plan: ExpertsPlan) -> str:
    """The summary's account of what the plan writes."""
    target, ranks = plan.target, plan.ranks
    return (
        f"DeepSpeed MoE ep{ranks.ep_size} x {ranks.world_size} ranks ZeRO-{target.stage} fp32 "
        f"checkpoint (tag {target.tag}, {len(plan.files) - 1} files)"
    )


def export_deepspeed_experts(
    store: StoreLike | UniversalCheckpoint,
    out: str | Path,
    *,
    world_size: int,
    stage: int,
    ep_size: int,
    dtype: str | torch.dtype | None = None,
    ds_config: dict[str, Any] | None = None,
    tag: str | None = None,
    overwrite: bool = False,
    remove_previous: bool = False,
    dry_run: bool = False,
    hooks: ExportHooks | None = None,
) -> ExportResult:
    """Write native DeepSpeed MoE files for ``world_size`` ranks at ``ep_size``, ZeRO ``stage``.

    Args: as :func:`ucformat.export.export_deepspeed`, plus ``ep_size``: the expert-parallel
    size of the target job's MoE layers (it divides ``world_size`` and each layer's experts).

    Raises:
        UnsupportedExportError: see :func:`plan_deepspeed_experts`.
        StoreExistsError: the tag folder exists and ``overwrite`` is not set.
    """
    clock = Stopwatch()
    ckpt = open_store_arg(store)
    if is_url(out):
        raise _refuse(f"it writes to a local folder, not to a URL ({out}); upload the folder.")
    export = NativeExport(
        plan=lambda chosen: plan_deepspeed_experts(
            ckpt.manifest,
            world_size=world_size,
            stage=stage,
            ep_size=ep_size,
            dtype=dtype,
            ds_config=ds_config,
            tag=chosen,
        ),
        write=_write_files,
        describe=_describe,
        notes=lambda dest: [],
    )
    return run_native_export(
        ckpt,
        out,
        export,
        world_size=world_size,
        stage=stage,
        tag=tag,
        overwrite=overwrite,
        remove_previous=remove_previous,
        dry_run=dry_run,
        hooks=hooks or ExportHooks(),
        clock=clock,
    )
