"""torchtitan's ``step-N/`` folders (its CheckpointManager): the loop state beside the weights.

torchtitan saves one DCP checkpoint of ``{**model_state_dict, "optimizer", "lr_scheduler",
"dataloader", "train_state"}``: the model's keys at the top level (read by
:mod:`~ucformat.sources.dcp_layout`), everything else client state. Its Trainer's own state,
``Trainer.state_dict()``, is ``{"step": int, "ntokens_seen": int}``, saved as DCP bytes entries
``train_state.step`` and ``train_state.ntokens_seen``. The step is the number of optimizer steps
taken, which is what the manifest's ``progress.global_steps`` records.

Fused QKV (``fuse_qkv=True``, every llama3 flavour): torchtitan's state-dict hook saves the fused
``wqkv`` weight split into ``wq``/``wk``/``wv`` while the optimizer state stays under ``wqkv``.
Its rows interleave per KV head (``n_kv`` groups of ``n_heads // n_kv`` query heads, one key
head and one value head, each ``head_dim`` rows); ``head_dim`` is not saved anywhere in the
folder (the RoPE cache is a non-persistent buffer, no model arguments are saved), so the state
cannot be rejoined exactly and the layout is refused (``dcp_layout``, one line). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ucformat.format.models import TrainingProgress
from ucformat.sources.base import SourceParam, optimizer_steps

__all__ = ["TRAIN_STEP_KEY", "training_progress"]

#: The client-state key of torchtitan's ``Trainer.step``.
TRAIN_STEP_KEY = "train_state.step"


def training_progress(
    client_values: Mapping[str, Any], params: Mapping[str, SourceParam] | None = None
) -> TrainingProgress:
    """The progress a DCP folder records: torchtitan's ``train_state.step`` (a non-negative
    int in its client state) as ``global_steps``; else the optimizer's steps
    (:func:`~ucformat.sources.base.optimizer_steps` of ``params``: what ``ucformat.torch.save``
    records for the same state); else nothing (zeros)."""
    step = client_values.get(TRAIN_STEP_KEY)
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return TrainingProgress(global_steps=step)
    return TrainingProgress(global_steps=optimizer_steps(params or {}))
