"""Megatron-Core ``torch_dist`` checkpoints (``dist_checkpointing.save``) as a ``SourceCheckpoint``.

One idea per module: :mod:`.files` (the folder's files, opened), :mod:`.keys` (what each key is,
the store's names), :mod:`.params` (weights as per-layer, per-expert parameters),
:mod:`.optimizers` (the chained optimizers ``common.pt`` records, group membership),
:mod:`.buckets` (the distributed optimizer's ``dp_reshardable`` buckets cut into parameters),
:mod:`.proof` (masters against weights), :mod:`.fused` (``linear_qkv`` and SwiGLU layouts),
:mod:`.client` (args, counters, RNG states), :mod:`.describe` (the reader).
"""

from __future__ import annotations

from ucformat.sources.megatron.describe import read_megatron_checkpoint
from ucformat.sources.megatron.files import is_megatron_folder

__all__ = ["is_megatron_folder", "read_megatron_checkpoint"]
