"""A store's optimizer groups and steps in torch.optim's terms (both torch loaders use it).

Pure translation of manifest data: FusedAdam's hyper-parameter keys to torch Adam's, the decoupled
(AdamW) weight-decay flag, a stored group merged into a live one, a step as torch keeps it.
"""

from __future__ import annotations

from typing import Any

import torch

from ucformat.errors import ModelMismatchError
from ucformat.format.models import CheckpointManifest
from ucformat.format.pyvalue import decode

__all__ = [
    "is_deepspeed_adam",
    "merged_group",
    "stored_decoupled",
    "torch_group",
    "torch_step_tensor",
]

#: Keys of a torch Adam/AdamW param group besides ``params``, with torch's defaults.
TORCH_ADAM_DEFAULTS: dict[str, Any] = {
    "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
    "differentiable": False, "fused": None,
}  # fmt: skip


def is_deepspeed_adam(manifest: CheckpointManifest) -> bool:
    """True if the store's optimizer was DeepSpeed's own Adam (FusedAdam / DeepSpeedCPUAdam)."""
    name = manifest.optimizer.name if manifest.optimizer else ""
    return name.rpartition(".")[2] in ("FusedAdam", "DeepSpeedCPUAdam")


def stored_decoupled(manifest: CheckpointManifest, hyper: dict[str, Any]) -> bool | None:
    """Whether the stored group used decoupled (AdamW) weight decay; None if unknown."""
    if "decoupled_weight_decay" in hyper:
        return bool(hyper["decoupled_weight_decay"])
    if manifest.optimizer is not None and manifest.optimizer.adam_w_mode is not None:
        return manifest.optimizer.adam_w_mode
    if manifest.optimizer is not None and manifest.optimizer.name.endswith("AdamW"):
        return True
    return None


def torch_group(manifest: CheckpointManifest, index: int) -> dict[str, Any]:
    """Group ``index``'s hyper-parameters in torch's format (FusedAdam keys translated)."""
    assert manifest.optimizer is not None
    hyper = {k: decode(v) for k, v in manifest.optimizer.groups[index].hyperparams.items()}
    if not is_deepspeed_adam(manifest):
        return hyper
    group: dict[str, Any] = {
        k: hyper[k] for k in ("lr", "betas", "eps", "weight_decay") if k in hyper
    }
    if "betas" in group:
        group["betas"] = tuple(group["betas"])
    group.update(TORCH_ADAM_DEFAULTS)
    group["amsgrad"] = bool(hyper.get("amsgrad", False))
    group["decoupled_weight_decay"] = bool(stored_decoupled(manifest, hyper))
    return group


def torch_step_tensor(value: Any) -> torch.Tensor:
    """A step as torch's Adam keeps it: a 0-d tensor of the default scalar dtype."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(float(value), dtype=dtype)


def merged_group(
    manifest: CheckpointManifest, index: int, live: dict[str, Any], strict: bool
) -> dict[str, Any]:
    """A live group's hyper-parameters with the stored values of the keys both have."""
    stored = torch_group(manifest, index)
    decoupled = stored_decoupled(manifest, stored)
    live_decoupled = live.get("decoupled_weight_decay")
    known = decoupled is not None and live_decoupled is not None
    if strict and known and bool(live_decoupled) != decoupled and stored.get("weight_decay", 0):
        want = "torch.optim.AdamW" if decoupled else "torch.optim.Adam"
        raise ModelMismatchError(
            f"the store's optimizer used {'decoupled (AdamW)' if decoupled else 'L2 (Adam)'} "
            f"weight decay but the optimizer does not; use {want}, or pass strict=False to "
            "keep the optimizer's own setting. Nothing was loaded."
        )
    merged = {k: v for k, v in live.items() if k != "params"}
    for key in merged:
        if key in stored and key != "decoupled_weight_decay":
            merged[key] = stored[key]
    return merged
