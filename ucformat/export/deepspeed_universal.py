"""``ucformat export deepspeed-universal``: DeepSpeed's own universal checkpoint folder.

The layout ``ds_to_universal`` writes and DeepSpeed's loader reads with
``{"checkpoint": {"load_universal": true}}`` and ``engine.load_checkpoint(out)``::

    out/latest_universal                       -> "<tag>"
    out/<tag>/mp_rank_00_model_states.pt       read by ZeRO-1/2 engines
    out/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   read by ZeRO-3 engines
    out/<tag>/zero/optimizer_state.pt          loss scaler, clip, param groups, step
    out/<tag>/zero/<fqn>/fp32.pt, exp_avg.pt, exp_avg_sq.pt   {'param': full fp32, 'cat_dim': 0}
    out/<tag>/zero/<fqn>/step.pt               the step, with its original type

Unlike ``ds_to_universal``'s output, one folder serves every target stage: both model-states
names are written, ``optimizer_state.pt`` carries both the ZeRO-1/2 keys (``param_groups``
and the global state at top level) and the ZeRO-3 ones (``optimizer_state_dict`` with the step
and param groups), and the per-parameter files use the dict form both loaders accept.
Each parameter file holds one full tensor; the export reads and writes one array at a time.

DeepSpeed 0.19.8's universal loader never restores frozen parameters or buffers, copies param
group 0's hyper-parameters into every group at ZeRO-3, and crashes (IndexError) at ZeRO-1/2
when a new rank's partition of a param group is all padding (see docs/exports.md).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from ucformat.errors import UnsupportedExportError
from ucformat.export.common import (
    ExportHooks,
    ExportResult,
    Stopwatch,
    open_store_arg,
)
from ucformat.export.deepspeed_common import (
    DeepSpeedClasses,
    build_loss_scaler,
    deepspeed_classes,
    flat_group_step,
    frozen_names,
    group_shapes,
    model_states,
    module_state_dict,
    require_optimizer,
)
from ucformat.export.destination import prepare_destination, save_torch, transactional, write_bytes
from ucformat.export.url_target import export_to_url, is_url
from ucformat.format.models import CheckpointManifest
from ucformat.format.pyvalue import decode
from ucformat.format.spec import FP32_STATE, STEP_STATE
from ucformat.format.summary import format_bytes
from ucformat.read.checkpoint import UniversalCheckpoint, scalar_value
from ucformat.sources.deepspeed.files import model_states_file
from ucformat.store.keys import StoreLike

__all__ = ["LATEST_UNIVERSAL", "export_deepspeed_universal", "plan_deepspeed_universal"]

LATEST_UNIVERSAL = "latest_universal"
MODEL_FILE = model_states_file()
ZERO3_MODEL_FILE = model_states_file(0)
OPTIMIZER_FILE = "zero/optimizer_state.pt"


def _check_names(manifest: CheckpointManifest) -> None:
    for name in manifest.params:
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise UnsupportedExportError(
                f"parameter name '{name}' cannot be a folder name under zero/ (DeepSpeed "
                "names the per-parameter folder after it); rename the parameter."
            )


def plan_deepspeed_universal(
    manifest: CheckpointManifest, *, tag: str | None = None
) -> tuple[str, list[str], int]:
    """(tag, files relative to the output folder, tensor payload bytes), from the manifest."""
    require_optimizer(manifest, "deepspeed-universal")
    _check_names(manifest)
    assert manifest.optimizer is not None
    name = tag or f"{manifest.source.tag}_universal"
    files = [f"{name}/{MODEL_FILE}", f"{name}/{ZERO3_MODEL_FILE}", f"{name}/{OPTIMIZER_FILE}"]
    states = [FP32_STATE, *manifest.optimizer.state_keys]
    payload = 0
    for group in manifest.optimizer.groups:
        for member in group.params:
            entry = manifest.params[member]
            files += [f"{name}/zero/{member}/{state}.pt" for state in states]
            if STEP_STATE in entry.scalars:
                files.append(f"{name}/zero/{member}/{STEP_STATE}.pt")
            payload += entry.numel * 4 * len(states)
    files.append(LATEST_UNIVERSAL)
    return name, files, payload


def _source_config(manifest: CheckpointManifest) -> dict[str, Any]:
    config = decode(manifest.source.ds_config) if manifest.source.ds_config is not None else {}
    return config if isinstance(config, dict) else {}


def _optimizer_state(ckpt: UniversalCheckpoint, classes: DeepSpeedClasses) -> dict[str, Any]:
    """``zero/optimizer_state.pt``, readable by the ZeRO-1/2 and the ZeRO-3 universal loaders."""
    manifest = ckpt.manifest
    assert manifest.optimizer is not None
    config = _source_config(manifest)
    scaler, dynamic = build_loss_scaler(classes, manifest, manifest.source.train_dtype, config)
    clip = manifest.progress.clip_grad
    if clip is None:
        clip = float(config.get("gradient_clipping", 1.0))
    groups = manifest.optimizer.groups
    hyper = [{k: decode(v) for k, v in group.hyperparams.items()} for group in groups]
    step = flat_group_step(manifest, [n for g in groups for n in g.params][:1], "the store")
    zero3_state: dict[int, dict[str, Any]] = {0: {"step": step}} if step is not None else {}
    world = manifest.source.world_size
    return {
        "loss_scaler": scaler,
        "dynamic_loss_scale": dynamic,
        "overflow": bool(manifest.progress.overflow),
        "clip_grad": clip,
        # A store saved by another framework has no ZeRO stage: DeepSpeed's universal loader
        # reads the stage from the engine it loads into, this value is informational.
        "zero_stage": classes.zero_stage(manifest.source.zero_stage or 1),
        "group_paddings": [0] * len(groups),
        "partition_count": [world] * len(groups),
        "ds_version": classes.version,
        "param_groups": [{**hp, "params": [i]} for i, hp in enumerate(hyper)],
        "optimizer_state_dict": {
            "state": zero3_state,
            "param_groups": [{**hp, "params": [i]} for i, hp in enumerate(hyper)],
        },
    }


def _model_states(
    ckpt: UniversalCheckpoint, classes: DeepSpeedClasses, *, placeholders: bool
) -> tuple[dict[str, Any], list[str]]:
    manifest = ckpt.manifest
    assert manifest.optimizer is not None
    frozen = frozen_names(manifest)
    module = module_state_dict(ckpt, manifest.source.train_dtype, placeholders=placeholders)
    stage12 = not placeholders
    return model_states(
        manifest,
        module=module,
        param_shapes=group_shapes(manifest, [g.params for g in manifest.optimizer.groups]),
        frozen_shapes=OrderedDict((n, torch.Size(manifest.params[n].shape)) for n in frozen),
        frozen_fragments=OrderedDict((n, module[n]) for n in frozen) if stage12 else None,
        shared_params=dict(manifest.tied),
        world_size=manifest.source.world_size,
        ds_config=_source_config(manifest),
        ds_version=classes.version,
    )


@transactional
def export_deepspeed_universal(
    store: StoreLike | UniversalCheckpoint,
    out: str | Path,
    *,
    tag: str | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    hooks: ExportHooks | None = None,
) -> ExportResult:
    """Write DeepSpeed's universal checkpoint folder, loadable at any world size and stage.

    Args:
        store: a store path/URL/``Store`` or an opened checkpoint.
        out: the folder to pass to ``engine.load_checkpoint`` (``out/<tag>/`` and
            ``out/latest_universal`` are written); must be empty unless ``overwrite``. A URL
            (``s3://...``) is written locally, then uploaded (docs/s3.md).
        tag: folder name (default ``<source tag>_universal``).
        overwrite: replace ``out/<tag>`` and ``out/latest_universal`` (other files are kept).
        dry_run: plan only; write nothing (DeepSpeed is not needed).
        hooks: progress callbacks.

    Raises:
        UnsupportedExportError: the store has no optimizer state, or DeepSpeed is not
            importable.

    Example:
        >>> ucformat.export.export_deepspeed_universal("ckpt.ucf", "uc/")  # doctest: +SKIP
    """
    clock = Stopwatch()
    hooks = hooks or ExportHooks()
    ckpt = open_store_arg(store)
    name, files, payload = plan_deepspeed_universal(ckpt.manifest, tag=tag)
    owned = lambda entry: entry in (name, LATEST_UNIVERSAL)  # noqa: E731
    if is_url(out):
        return export_to_url(
            str(out),
            lambda folder: export_deepspeed_universal(
                ckpt, folder, tag=tag, dry_run=dry_run, hooks=hooks
            ),
            owned=owned,
            overwrite=overwrite,
            dry_run=dry_run,
            last=(LATEST_UNIVERSAL,),
        )
    folder = Path(out)
    notes: list[str] = []
    manifest = ckpt.manifest
    if not dry_run:
        classes = deepspeed_classes("deepspeed-universal")
        staged = prepare_destination(
            folder, overwrite=overwrite, owned=owned, dry_run=False, last=(LATEST_UNIVERSAL,)
        )
        hooks.plan(payload)
        root = staged / name
        (root / "zero").mkdir(parents=True, exist_ok=True)
        for file, placeholders in ((MODEL_FILE, False), (ZERO3_MODEL_FILE, True)):
            state, notes = _model_states(ckpt, classes, placeholders=placeholders)
            save_torch(state, root / file)
        save_torch(_optimizer_state(ckpt, classes), root / OPTIMIZER_FILE)
        _write_params(ckpt, root / "zero", hooks)
        write_bytes(staged / LATEST_UNIVERSAL, name.encode())
    else:
        prepare_destination(folder, overwrite=overwrite, owned=owned, dry_run=True)
    frozen = frozen_names(manifest)
    if frozen or manifest.buffers:
        notes.append(
            f"DeepSpeed's universal loader does not restore frozen parameters ({len(frozen)}) "
            f"or buffers ({len(manifest.buffers)}); they are in the model-states file only"
        )
    verb = "would write" if dry_run else "wrote"
    count = sum(len(g.params) for g in manifest.optimizer.groups) if manifest.optimizer else 0
    summary = (
        f"{verb} DeepSpeed universal checkpoint '{name}' ({count} params, "
        f"{format_bytes(payload)}) to {folder} in {clock.seconds:.2f}s"
    )
    return ExportResult(
        "deepspeed-universal", folder, files, payload, dry_run, clock.seconds, summary, notes
    )


def _write_params(ckpt: UniversalCheckpoint, zero: Path, hooks: ExportHooks) -> None:
    manifest = ckpt.manifest
    assert manifest.optimizer is not None
    states = [FP32_STATE, *manifest.optimizer.state_keys]
    for group in manifest.optimizer.groups:
        for name in group.params:
            entry = manifest.params[name]
            folder = zero / name
            folder.mkdir(exist_ok=True)
            for state in states:
                value = ckpt.read(name, state).to(torch.float32)
                save_torch({"param": value, "cat_dim": 0}, folder / f"{state}.pt")
                hooks.advance(value.numel() * 4)
                del value
            if STEP_STATE in entry.scalars:
                save_torch(scalar_value(entry.scalars[STEP_STATE]), folder / "step.pt")
