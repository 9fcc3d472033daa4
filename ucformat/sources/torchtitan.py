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
folder (the RoPE cache is a non-persistent buffer, no model arguments are saved), so without it
the layout is refused (``dcp_layout``, one line naming ``--head-dim``). Given ``head_dim``
(torchtitan's ``dim // n_heads`` unless the flavour sets it), :func:`fused_qkv_blocks` says
which rows of ``wq``/``wk``/``wv`` make which rows of ``wqkv`` and :func:`join_rows` rejoins the
weights' fragments: the store holds ``wqkv`` as the live model and its optimizer do, exactly.
Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ucformat.errors import LayoutMismatchError
from ucformat.format.models import TrainingProgress
from ucformat.sources.base import ArraySource, SourceFragment, SourceParam, optimizer_steps

__all__ = ["TRAIN_STEP_KEY", "RowBlock", "fused_qkv_blocks", "join_rows", "training_progress"]

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


@dataclass(frozen=True)
class RowBlock:
    """Rows ``[src_row, src_row + rows)`` of part ``part`` are rows from ``dst_row`` on of the
    joined array."""

    part: int
    src_row: int
    dst_row: int
    rows: int


def fused_qkv_blocks(
    shapes: Sequence[tuple[int, ...]], head_dim: int, where: str
) -> tuple[tuple[int, ...], list[RowBlock]]:
    """The fused shape and row blocks of ``wq``, ``wk``, ``wv`` (``shapes``, in that order)
    for heads of ``head_dim`` rows.

    >>> shape, blocks = fused_qkv_blocks([(8, 3), (4, 3), (4, 3)], 2, "x")
    >>> shape, [(b.part, b.src_row, b.dst_row) for b in blocks][:4]
    ((16, 3), [(0, 0, 0), (1, 0, 4), (2, 0, 6), (0, 4, 8)])

    Raises:
        LayoutMismatchError: the shapes do not split into heads of ``head_dim`` rows with as
            many key as value heads and a whole number of query heads per key head.
    """
    q, k, v = (shape[0] if shape else 0 for shape in shapes)
    tails = {tuple(shape[1:]) for shape in shapes}
    n_kv = k // head_dim if head_dim > 0 else 0
    fits = (
        len(tails) == 1
        and all(len(shape) >= 1 for shape in shapes)
        and head_dim > 0
        and k == v
        and n_kv > 0
        and k % head_dim == 0
        and q % (n_kv * head_dim) == 0
    )
    if not fits:
        raise LayoutMismatchError(
            f"{where}: --head-dim {head_dim} does not fit the split weights of shapes "
            f"{[list(s) for s in shapes]} (wq rows must be a multiple of wk's, wk and wv rows "
            "equal and a multiple of the head dimension); pass the model's head dimension."
        )
    per_kv = q // n_kv  # query rows per KV head
    blocks = []
    for group in range(n_kv):
        base = group * (per_kv + 2 * head_dim)
        blocks.append(RowBlock(0, group * per_kv, base, per_kv))
        blocks.append(RowBlock(1, group * head_dim, base + per_kv, head_dim))
        blocks.append(RowBlock(2, group * head_dim, base + per_kv + head_dim, head_dim))
    return (q + k + v, *next(iter(tails))), blocks


def join_rows(
    parts: Sequence[ArraySource], shape: tuple[int, ...], blocks: Sequence[RowBlock]
) -> ArraySource:
    """The array of ``shape`` whose row blocks come from ``parts`` (their fragments cut at
    the blocks' edges and moved to their rows)."""
    row = math.prod(shape[1:])
    joined = ArraySource(shape, parts[0].dtype)
    for block in blocks:
        low, high = block.src_row * row, (block.src_row + block.rows) * row
        shift = (block.dst_row - block.src_row) * row
        for fragment in parts[block.part].fragments:
            start = max(low, fragment.start)
            stop = min(high, fragment.start + fragment.length)
            if start < stop:
                joined.fragments.append(
                    SourceFragment(
                        fragment.tensor,
                        fragment.tensor_start + start - fragment.start,
                        start + shift,
                        stop - start,
                    )
                )
    return joined
