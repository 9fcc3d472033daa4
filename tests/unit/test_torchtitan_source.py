"""ucformat.sources.torchtitan: torchtitan's ``train_state.step`` becomes the store's progress."""

from __future__ import annotations

from typing import Any

import pytest

from ucformat.sources.torchtitan import TRAIN_STEP_KEY, training_progress


def test_torchtitan_step_is_the_global_step() -> None:
    values = {TRAIN_STEP_KEY: 300, "train_state.ntokens_seen": 12345, "lr_scheduler.x": 1}
    assert training_progress(values).global_steps == 300


@pytest.mark.parametrize(
    "values",
    [{}, {TRAIN_STEP_KEY: True}, {TRAIN_STEP_KEY: -1}, {TRAIN_STEP_KEY: "3"}, {"step": 3}],
)
def test_anything_else_records_no_progress(values: dict[str, Any]) -> None:
    progress = training_progress(values)
    assert (progress.global_steps, progress.global_samples) == (0, 0)


class _Memory:
    """A flat tensor in memory, read the way the converter's writer reads fragments."""

    def __init__(self, values: list[int]) -> None:
        self.values = values


def _materialize(array: Any) -> list[int]:
    out = [-1] * (array.shape[0] * array.shape[1])
    for fragment in array.fragments:
        source = fragment.tensor.values[
            fragment.tensor_start : fragment.tensor_start + fragment.length
        ]
        out[fragment.start : fragment.start + fragment.length] = source
    return out


@pytest.mark.parametrize(
    ("n_heads", "n_kv", "head_dim", "cols", "cut"),
    [(4, 2, 2, 3, 5), (8, 2, 3, 4, 7), (6, 6, 1, 2, 3), (4, 1, 4, 1, 2)],
)
def test_rejoined_rows_interleave_per_kv_head_as_torchtitan_fuses_them(
    n_heads: int, n_kv: int, head_dim: int, cols: int, cut: int
) -> None:
    """Against torchtitan's own rule (reshape to (n_kv, heads, head_dim, cols), concatenate q,
    k, v per KV head), with each part's fragments cut at arbitrary places (FSDP2 shards)."""
    import torch

    from ucformat.sources.base import ArraySource, SourceFragment
    from ucformat.sources.torchtitan import fused_qkv_blocks, join_rows

    per_kv = n_heads // n_kv
    q = torch.arange(n_heads * head_dim * cols).reshape(-1, cols)
    k = 1000 + torch.arange(n_kv * head_dim * cols).reshape(-1, cols)
    v = 2000 + torch.arange(n_kv * head_dim * cols).reshape(-1, cols)
    fused = torch.cat(
        [t.reshape(n_kv, n, head_dim, cols) for t, n in ((q, per_kv), (k, 1), (v, 1))], dim=1
    ).reshape(-1, cols)
    parts = []
    for tensor in (q, k, v):
        flat = tensor.reshape(-1).tolist()
        array = ArraySource(tuple(tensor.shape), "int64")
        for start in range(0, len(flat), cut):  # fragments of `cut` elements, each its own tensor
            piece = _Memory(flat[start : start + cut])
            array.fragments.append(SourceFragment(piece, 0, start, len(piece.values)))
        parts.append(array)
    shape, blocks = fused_qkv_blocks([tuple(t.shape) for t in (q, k, v)], head_dim, "x")
    assert shape == tuple(fused.shape)
    assert _materialize(join_rows(parts, shape, blocks)) == fused.reshape(-1).tolist()


@pytest.mark.parametrize(
    "shapes", [[(8, 3), (4, 3), (2, 3)], [(6, 3), (4, 3), (4, 3)], [(8, 3), (4, 2), (4, 3)]]
)
def test_head_dims_that_do_not_fit_are_refused(shapes: list[tuple[int, int]]) -> None:
    from ucformat.errors import LayoutMismatchError
    from ucformat.sources.torchtitan import fused_qkv_blocks

    with pytest.raises(LayoutMismatchError, match="--head-dim 2 does not fit"):
        fused_qkv_blocks(shapes, 2, "ckpt: 'w'")
