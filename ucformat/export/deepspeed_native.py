"""``ucformat export deepspeed``: a native ZeRO checkpoint for a new world size and stage.

The output is what DeepSpeed 0.19.8 itself writes from ``engine.save_checkpoint(out, tag)`` in
a job of ``world_size`` data-parallel ranks at ZeRO ``stage``: the same file names, dict keys,
flat layouts, pickled DeepSpeed objects and ``latest`` pointer. A stock
``engine.load_checkpoint(out)`` in that job (no ucformat installed, no ``load_universal``)
therefore restores model, frozen parameters, buffers, fp32 master weights, optimizer state,
step, hyper-parameters, scheduler, loss scaler and counters, so that HF Trainer / Lightning
users resume at a new size without code changes.

Algorithm:

1. :func:`~ucformat.export.native_target.native_target` derives the target job from the
   options and the DeepSpeed config (the source's unless given), and
   :func:`~ucformat.export.native_target.plan_native` computes every flat buffer's layout at
   the new world size with :mod:`ucformat.layout.partition` (pure; ``--dry-run`` stops here).
2. The model-states file(s) are written, then one optimizer-states file per rank, each built
   from exactly the flat ranges that rank owns, then ``latest`` (last, as the commit); the
   steps around the files are :func:`~ucformat.export.native_export.run_native_export`'s.

Differences from a DeepSpeed-written checkpoint, none of which DeepSpeed reads: ZeRO-3 padding
is zeros instead of uninitialised memory; the ``module`` dict lists parameters, then buffers,
then tied aliases (DeepSpeed interleaves them by submodule); ``zero_to_fp32.py`` is not copied;
the rigid (non-elastic) ZeRO-1/2 layout is always written (DeepSpeed loads it in both modes).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from ucformat.export.common import (
    ExportHooks,
    ExportResult,
    Stopwatch,
    open_store_arg,
)
from ucformat.export.deepspeed_common import (
    DeepSpeedClasses,
    build_loss_scaler,
    group_shapes,
    model_states,
    module_state_dict,
)
from ucformat.export.deepspeed_experts import export_deepspeed_experts
from ucformat.export.destination import save_torch, transactional
from ucformat.export.hf_trainer import trainer_notes
from ucformat.export.native_export import NativeExport, run_native_export
from ucformat.export.native_files import RankFiles, frozen_fragments
from ucformat.export.native_target import NativePlan, native_target, plan_native
from ucformat.format.models import CheckpointManifest
from ucformat.format.summary import format_bytes
from ucformat.read.checkpoint import UniversalCheckpoint
from ucformat.store.keys import StoreLike

__all__ = ["export_deepspeed", "plan_deepspeed"]


def plan_deepspeed(
    manifest: CheckpointManifest,
    *,
    world_size: int,
    stage: int,
    dtype: str | torch.dtype | None = None,
    ds_config: dict[str, Any] | None = None,
    tag: str | None = None,
) -> NativePlan:
    """Plan a native export from the manifest alone (options as in :func:`export_deepspeed`)."""
    dtype_name = None if dtype is None else str(dtype).removeprefix("torch.")
    target = native_target(
        manifest, world_size=world_size, stage=stage, dtype=dtype_name, ds_config=ds_config, tag=tag
    )
    return plan_native(manifest, target)


def _write_model_files(
    ckpt: UniversalCheckpoint, plan: NativePlan, classes: DeepSpeedClasses, tag_dir: Path
) -> list[str]:
    """Write every model-states file (one dict in memory at a time); return the notes."""
    target = plan.target
    manifest = ckpt.manifest
    shapes = group_shapes(manifest, [g.members for g in plan.flat_groups])
    frozen = list(plan.frozen)
    frozen_shapes = OrderedDict((n, torch.Size(manifest.params[n].shape)) for n in frozen)
    common: dict[str, Any] = {
        "param_shapes": shapes,
        "world_size": target.world_size,
        "ds_config": target.ds_config,
        "ds_version": classes.version,
    }
    if target.stage in (1, 2):
        module = module_state_dict(ckpt, target.dtype, placeholders=False)
        stage2 = target.stage == 2
        state, notes = model_states(
            manifest,
            module=module,
            frozen_shapes=frozen_shapes if stage2 else None,
            frozen_fragments=OrderedDict((n, module[n]) for n in frozen) if stage2 else None,
            shared_params=dict(manifest.tied),
            **common,
        )
        save_torch(state, tag_dir / target.model_file(0))
        return notes
    module = module_state_dict(ckpt, target.dtype, placeholders=True)
    notes = []
    for rank in range(target.world_size):
        fragments = frozen_fragments(ckpt, frozen, target.dtype, target.world_size, rank)
        state, notes = model_states(
            manifest,
            module=module,
            frozen_shapes=frozen_shapes,
            frozen_fragments=fragments,
            shared_params=dict(manifest.tied) if rank == 0 else {},  # rank 0's file only
            **common,
        )
        save_torch(state, tag_dir / target.model_file(rank))
    return notes


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _write_files(
    ckpt: UniversalCheckpoint,
    plan: NativePlan,
    classes: DeepSpeedClasses,
    tag_dir: Path,
    hooks: ExportHooks,
) -> list[str]:
    """Write the model-states files, then one optimizer-states file per rank; return the notes."""
    target = plan.target
    scaler, dynamic = build_loss_scaler(classes, ckpt.manifest, target.dtype, target.ds_config)
    notes = _write_model_files(ckpt, plan, classes, tag_dir)
    files = RankFiles(ckpt, plan, classes, scaler, dynamic)
    for rank in range(target.world_size):
        save_torch(files.optimizer_file(rank), tag_dir / target.optim_file(rank))
        hooks.advance(files.payload_per_rank)
    return notes


def _describe(plan: NativePlan) -> str:
    """The summary's account of what the plan writes."""
    target = plan.target
    return (
        f"DeepSpeed ZeRO-{target.stage} x{target.world_size} {target.dtype} checkpoint "
        f"({target.wrapper}, {_count(len(plan.flat_groups), 'flat group')}, tag {target.tag}, "
        f"{format_bytes(plan.nbytes)} optimizer state)"
    )


@transactional
def export_deepspeed(
    store: StoreLike | UniversalCheckpoint,
    out: str | Path,
    *,
    world_size: int,
    stage: int,
    dtype: str | torch.dtype | None = None,
    ds_config: dict[str, Any] | None = None,
    tag: str | None = None,
    overwrite: bool = False,
    remove_previous: bool = False,
    dry_run: bool = False,
    hooks: ExportHooks | None = None,
    ep_size: int | None = None,
) -> ExportResult:
    """Write a native DeepSpeed ZeRO checkpoint for ``world_size`` ranks at ``stage``.

    ``out`` may be an empty folder, or a DeepSpeed run folder (one with ``latest``, such as a
    Hugging Face Trainer ``checkpoint-N/``): the export then adds a tag beside the existing
    ones and repoints ``latest``, as ``engine.save_checkpoint`` does, and leaves every other
    file alone (docs/trainer.md).

    Args:
        store: a store path/URL/``Store`` or an opened checkpoint.
        out: the checkpoint folder (``engine.load_checkpoint(out)``): ``out/<tag>/`` and
            ``out/latest`` are written. A URL (``s3://...``) is written locally, then
            uploaded (docs/s3.md); it must be empty unless ``overwrite``.
        world_size: data-parallel ranks of the job that will load it.
        stage: ZeRO stage 1, 2 or 3.
        dtype: training dtype ``fp32``/``fp16``/``bf16`` (default: the config's, else the
            source's).
        ds_config: the target job's DeepSpeed config (default: the source's); decides the
            optimizer wrapper, ZeRO-3 ``sub_group_size``, ``parameter_alignment`` and
            ``gradient_clipping``, and is stored in the files. ``"auto"`` values (Hugging
            Face configs) take the source's value.
        tag: checkpoint tag. Default: the source's tag, or ``<source tag>_ws<W>_zero<S>`` when
            ``out`` is a run folder that already holds the source's tag.
        overwrite: replace ``out/<tag>`` if it exists (other tags are kept); in a non-empty
            folder without ``latest``, required at all.
        remove_previous: once the export is complete, remove the tag ``latest`` named before.
        dry_run: plan only; write nothing (DeepSpeed is not needed).
        hooks: progress callbacks.
        ep_size: an MoE store's target expert-parallel size (default: the source's); the
            export is then :func:`~ucformat.export.deepspeed_experts.export_deepspeed_experts`.

    Raises:
        UnsupportedExportError: the store has no optimizer state, the stage or config cannot be
            written, or DeepSpeed is not importable.
        StoreExistsError: the tag folder exists (or ``out`` is not a run folder and not empty)
            and ``overwrite`` is not set.

    Example:
        >>> from ucformat.export import export_deepspeed
        >>> export_deepspeed("ckpt.ucf", "run8/", world_size=8, stage=3)  # doctest: +SKIP
    """
    clock = Stopwatch()
    hooks = hooks or ExportHooks()
    ckpt = open_store_arg(store)
    if ckpt.manifest.experts is not None or ep_size is not None:  # MoE: docs/exports.md
        experts = ckpt.manifest.experts
        return export_deepspeed_experts(
            ckpt, out, world_size=world_size, stage=stage, dtype=dtype, ds_config=ds_config,
            tag=tag, overwrite=overwrite, remove_previous=remove_previous, dry_run=dry_run,
            hooks=hooks, ep_size=ep_size or (experts.ep_size if experts else 1),
        )  # fmt: skip
    export = NativeExport(
        plan=lambda chosen: plan_deepspeed(
            ckpt.manifest,
            world_size=world_size,
            stage=stage,
            dtype=dtype,
            ds_config=ds_config,
            tag=chosen,
        ),
        write=_write_files,
        describe=_describe,
        notes=lambda dest: dest.notes() + trainer_notes(dest.folder, ckpt.manifest, world_size),
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
        hooks=hooks,
        clock=clock,
    )
