"""What the native and universal DeepSpeed exports share: DeepSpeed's classes and model-states.

DeepSpeed pickles three of its own classes into every ZeRO file (the loss scaler,
``ZeroStageEnum`` and ``fragment_address``), and a stock DeepSpeed must unpickle what ucformat
writes. So these exports build real instances of DeepSpeed's classes, and DeepSpeed must be
importable at export time; it is an optional dependency (``pip install 'ucformat[deepspeed]'``)
and is imported only here, only when a DeepSpeed export runs.

The model-states file (``mp_rank_00_model_states.pt``, or one
``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per rank for ZeRO-3) is a plain dict whose keys
and order follow DeepSpeed 0.19.8's ``_common_checkpoint_state``, then the client state merged
at top level.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ucformat.errors import UnsupportedExportError
from ucformat.format.dtypes import torch_dtype
from ucformat.format.models import CheckpointManifest
from ucformat.format.pyvalue import decode
from ucformat.format.spec import BUFFER_STATE, FP32_STATE, STEP_STATE
from ucformat.read.checkpoint import UniversalCheckpoint

__all__ = [
    "DeepSpeedClasses",
    "build_loss_scaler",
    "client_state",
    "deepspeed_classes",
    "flat_group_step",
    "model_states",
    "module_state_dict",
    "require_optimizer",
]

#: Client-state keys under which the converter keeps DeepSpeed's own optional states.
_DS_CLIENT_KEYS = {"deepspeed.data_sampler": "data_sampler", "deepspeed.random_ltd": "random_ltd"}


@dataclass(frozen=True)
class DeepSpeedClasses:
    """The DeepSpeed classes pickled into checkpoint files, and DeepSpeed's version."""

    version: str
    loss_scaler: type
    dynamic_loss_scaler: type
    zero_stage: type
    fragment_address: type
    float16_config: Any


def deepspeed_classes(target: str) -> DeepSpeedClasses:
    """Import DeepSpeed's checkpoint classes, or explain that DeepSpeed is needed."""
    try:
        import deepspeed
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.precision_config import get_float16_config
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError as exc:
        raise UnsupportedExportError(
            f"'export {target}' needs DeepSpeed importable at export time (the files pickle "
            f"DeepSpeed's LossScaler, ZeroStageEnum and fragment_address), but importing it "
            f"failed: {exc}. Install it with: pip install 'ucformat[deepspeed]'."
        ) from exc
    return DeepSpeedClasses(
        version=str(deepspeed.__version__),
        loss_scaler=LossScaler,
        dynamic_loss_scaler=DynamicLossScaler,
        zero_stage=ZeroStageEnum,
        fragment_address=fragment_address,
        float16_config=get_float16_config,
    )


def require_optimizer(manifest: CheckpointManifest, target: str) -> None:
    """Refuse a store whose trainable parameters lack optimizer state, or that holds MoE experts."""
    if manifest.experts is not None:
        raise UnsupportedExportError(
            f"'export {target}': this store holds the experts of {len(manifest.experts.layers)} "
            f"MoE layers (source ep_size {manifest.experts.ep_size}); writing DeepSpeed MoE files "
            "is not supported yet; resume with ucformat.deepspeed.load, or use 'export "
            "safetensors' for the weights."
        )
    optimizer = manifest.optimizer
    if optimizer is None or not optimizer.groups:
        raise UnsupportedExportError(
            f"'export {target}' writes optimizer state, but this store has none (it was "
            "converted without optimizer state); use 'export safetensors' or "
            "ucformat.torch.state_dicts for the weights."
        )
    odd = sorted(
        {*optimizer.whole_keys, *(k for g in optimizer.groups for k in g.partition_states)}
    )
    if odd:
        raise UnsupportedExportError(
            f"'export {target}': this store holds optimizer states that are not elementwise "
            f"({', '.join(odd)}: format 3.1), which DeepSpeed's files cannot carry at another "
            "layout; resume with ucformat.deepspeed.load."
        )
    for group in optimizer.groups:
        for name in group.params:
            entry = manifest.params[name]
            missing = [k for k in optimizer.state_keys if k not in entry.states]
            missing += [k for k in optimizer.scalar_keys if k not in entry.scalars]
            if missing:
                raise UnsupportedExportError(
                    f"'export {target}': parameter '{name}' has no {', '.join(missing)} in "
                    "this store, so its optimizer state cannot be written; re-convert the "
                    "checkpoint with its optimizer shards."
                )


def flat_group_step(manifest: CheckpointManifest, members: Sequence[str], what: str) -> Any:
    """The one step value of a flat group (DeepSpeed keeps one per flat tensor)."""
    values = []
    for name in members:
        scalar = manifest.params[name].scalars.get(STEP_STATE)
        if scalar is not None:
            values.append((scalar.kind, scalar.dtype, scalar.value))
    if not values:
        return None
    if len(set(values)) != 1:
        raise UnsupportedExportError(
            f"{what} would hold parameters saved at different optimizer steps "
            f"({sorted({v[2] for v in values})}); DeepSpeed keeps one step per flat group, so "
            "choose a layout that keeps them apart (another world size or sub_group_size)."
        )
    kind, dtype, value = values[0]
    if kind == "tensor":
        return torch.tensor(value, dtype=torch_dtype(dtype or "float32"))
    return {"int": int, "float": float, "bool": bool}[kind](value)


def build_loss_scaler(
    classes: DeepSpeedClasses,
    manifest: CheckpointManifest,
    train_dtype: str,
    ds_config: dict[str, Any],
) -> tuple[Any, bool]:
    """The loss scaler DeepSpeed would pickle for ``train_dtype``, and ``dynamic_loss_scale``.

    fp16 keeps the store's scaler when the source trained in fp16; otherwise a fresh scaler is
    built from the config's ``fp16`` section exactly as DeepSpeed builds one. bf16 and fp32 get
    DeepSpeed's static scaler with scale 1.0.
    """
    if train_dtype != "float16":
        return classes.loss_scaler(scale=1.0), False
    saved = manifest.progress.loss_scaler
    if manifest.source.train_dtype == "float16" and saved is not None:
        cls = {
            "LossScaler": classes.loss_scaler,
            "DynamicLossScaler": classes.dynamic_loss_scaler,
        }.get(saved.class_name)
        if cls is not None:
            scaler: Any = object.__new__(cls)
            scaler.__dict__.update({k: decode(v) for k, v in saved.attributes.items()})
            return scaler, bool(saved.dynamic)
    config = classes.float16_config(ds_config)
    if config.loss_scale == 0:
        args = config.dynamic_loss_scale_args()
        return classes.dynamic_loss_scaler(dtype=torch.float16, **args), True
    return classes.loss_scaler(scale=config.loss_scale), False


def client_state(manifest: CheckpointManifest) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(client keys, DeepSpeed optional states, notes) to merge into a model-states file."""
    values: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for key, value in manifest.client_state.values.items():
        if key in _DS_CLIENT_KEYS:
            extras[_DS_CLIENT_KEYS[key]] = decode(value)
        else:
            values[key] = decode(value)
    notes = []
    if manifest.client_state.unrepresentable:
        lost = ", ".join(f"{k} ({t})" for k, t in manifest.client_state.unrepresentable.items())
        notes.append(f"client state kept by key and type only, not written: {lost}")
    return values, extras, notes


def module_state_dict(
    ckpt: UniversalCheckpoint, lp_dtype: str, *, placeholders: bool
) -> OrderedDict[str, torch.Tensor]:
    """``module.state_dict()`` as DeepSpeed saves it.

    Parameters (frozen ones too) in the training dtype, tied aliases sharing their owner's
    tensor, buffers in their own dtype. With ``placeholders`` (ZeRO-3) every parameter is an
    empty ``(0,)`` tensor. Key order: parameters in module order, then buffers, then aliases
    (DeepSpeed interleaves them by submodule; ``load_state_dict`` does not depend on order).
    """
    manifest = ckpt.manifest
    dtype = torch_dtype(lp_dtype)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name in manifest.params:
        if placeholders:
            out[name] = torch.empty(0, dtype=dtype)
        else:
            out[name] = ckpt.read(name, FP32_STATE).to(dtype)
    for name in manifest.buffers:
        out[name] = ckpt.read(name, BUFFER_STATE)
    for alias, owner in manifest.tied.items():
        out[alias] = torch.empty(0, dtype=dtype) if placeholders else out[owner]
    return out


def model_states(
    manifest: CheckpointManifest,
    *,
    module: OrderedDict[str, torch.Tensor],
    param_shapes: list[OrderedDict[str, torch.Size]],
    frozen_shapes: OrderedDict[str, torch.Size] | None,
    frozen_fragments: OrderedDict[str, torch.Tensor] | None,
    shared_params: dict[str, str],
    world_size: int,
    ds_config: dict[str, Any],
    ds_version: str,
) -> tuple[dict[str, Any], list[str]]:
    """The model-states dict DeepSpeed 0.19.8 writes, and notes on what could not be kept."""
    values, extras, notes = client_state(manifest)
    progress = manifest.progress
    state: dict[str, Any] = {
        "module": module,
        "buffer_names": list(manifest.buffers),
        "optimizer": None,
        "param_shapes": param_shapes,
        "frozen_param_shapes": frozen_shapes,
        "shared_params": shared_params,
        "frozen_param_fragments": frozen_fragments,
        "lr_scheduler": decode(progress.lr_scheduler),
        "data_sampler": extras.get("data_sampler"),
        "random_ltd": extras.get("random_ltd"),
        "skipped_steps": progress.skipped_steps,
        "global_steps": progress.global_steps,
        "global_samples": progress.global_samples,
        "dp_world_size": world_size,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": ds_config,
        "ds_version": ds_version,
    }
    state.update(values)
    return state, notes


def frozen_names(manifest: CheckpointManifest) -> list[str]:
    """Parameters the optimizer does not own, in module order (DeepSpeed's "frozen")."""
    return [name for name, entry in manifest.params.items() if entry.group is None]


def group_shapes(
    manifest: CheckpointManifest, groups: Sequence[Sequence[str]]
) -> list[OrderedDict[str, torch.Size]]:
    """``param_shapes``: one ordered ``name -> torch.Size`` per flat group."""
    return [
        OrderedDict((name, torch.Size(manifest.params[name].shape)) for name in members)
        for members in groups
    ]
