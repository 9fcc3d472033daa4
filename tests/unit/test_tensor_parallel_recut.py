"""Re-cutting recorded tensor-parallel splits for another degree (export deepspeed --tp T).

The near-even rule is checked against DeepSpeed's own ``get_shard_size_list``; the shards against
numpy slicing; the refusals name the parameter.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from ucformat.errors import UnsupportedExportError
from ucformat.export.tp_layout import target_shard_maps, tp_grain_size
from ucformat.format.tensor_parallel import (
    AffinePiece,
    ParamSplit,
    RankShard,
    SubParam,
    TensorParallelInfo,
)
from ucformat.layout.tensor_parallel import ShardMap, split_pieces
from ucformat.layout.tensor_parallel_recut import near_even, near_even_widths, recut_split


def test_near_even_widths_are_deepspeeds() -> None:
    """DeepSpeed's AutoTP split without kv heads and grain 1 (its fallback rule)."""
    tp_shard = pytest.importorskip("deepspeed.module_inject.tp_shard")
    meta = tp_shard.AutoTPMeta()
    for degree in range(1, 9):
        for size in range(0, 70):
            want = tp_shard.get_shard_size_list(size, degree, meta, "model.layers.0.mlp.up_proj")
            assert near_even_widths(size, degree) == want, (size, degree)
    assert near_even(97, [49, 48]) and not near_even(97, [48, 49]) and not near_even(4, [])


def _values(shard: ShardMap, logical: np.ndarray) -> np.ndarray:
    flat, out = logical.reshape(-1), np.empty(int(np.prod(shard.shard_shape)), logical.dtype)
    for run in shard.runs:
        out[run.shard_start : run.shard_start + run.length] = flat[
            run.logical_start : run.logical_start + run.length
        ]
    return out.reshape(shard.shard_shape)


@pytest.mark.parametrize(
    ("shape", "dim", "subs", "degree"),
    [((97, 4), 0, [97], 3), ((6, 10), 1, [10], 4), ((12, 3), 0, [4, 2, 6], 2), ((5,), 0, [5], 8)],
)
def test_recut_split_matches_numpy(
    shape: tuple[int, ...], dim: int, subs: list[int], degree: int
) -> None:
    logical = np.arange(int(np.prod(shape))).reshape(shape)
    shards = recut_split(shape, dim, subs, degree)
    assert len(shards) == degree
    for rank, (shard_shape, pieces) in enumerate(shards):
        got = _values(ShardMap.build(shape, shard_shape, pieces, "x"), logical)
        parts, start = [], 0
        for size in subs:
            widths = near_even_widths(size, degree)
            low = start + sum(widths[:rank])
            parts.append(np.take(logical, range(low, low + widths[rank]), axis=dim))
            start += size
        assert np.array_equal(got, np.concatenate(parts, axis=dim)), rank


def _split(shape: list[int], dim: int, widths: list[int], **extra: Any) -> ParamSplit:
    subs = extra.pop("subs", None)
    sub_widths = [s["widths"] for s in subs] if subs else [widths]
    shards = []
    for rank, pieces in enumerate(split_pieces(shape, dim, sub_widths)):
        shard = list(shape)
        shard[dim] = widths[rank]
        shards.append(
            RankShard(
                shard_shape=shard,
                pieces=[
                    AffinePiece(
                        shape=list(p.shape),
                        source_offset=p.source_offset,
                        source_strides=list(p.source_strides),
                        dest_offset=p.dest_offset,
                        dest_strides=list(p.dest_strides),
                    )
                    for p in pieces
                ],
            )
        )
    return ParamSplit(
        kind=extra.pop("kind", "split"),
        logical_shape=shape,
        dim=dim,
        widths=widths,
        sub_params=[SubParam(**s) for s in subs] if subs else None,
        shards=shards,
        **extra,
    )


def _rules(**params: ParamSplit) -> TensorParallelInfo:
    degree = len(next(iter(params.values())).shards)
    return TensorParallelInfo(framework="deepspeed-autotp", degree=degree, params=params)


def _entries(rules: TensorParallelInfo) -> dict[str, Any]:
    return {n: SimpleNamespace(shape=s.logical_shape) for n, s in rules.params.items()}


def test_target_maps_recut_and_keep() -> None:
    rules = _rules(
        head=_split([97, 4], 0, [49, 48]),  # uneven near-even: any degree
        o=_split([8, 8], 1, [4, 4]),  # even: divisors of 2 only
        qkv=_split(
            [12, 2], 0, [6, 6], subs=[{"size": 8, "widths": [4, 4]}, {"size": 4, "widths": [2, 2]}]
        ),
    )
    params = _entries(rules)
    same = target_shard_maps(params, rules, 2, "s")
    assert [m["qkv"].shard_shape for m in same] == [(6, 2), (6, 2)]
    whole = target_shard_maps(params, rules, 1, "s")
    assert whole[0]["o"].shard_shape == (8, 8) and len(whole[0]["o"].runs) == 1
    only_head = {"head": params["head"]}
    three = target_shard_maps(only_head, rules, 3, "s")
    assert [m["head"].shard_shape for m in three] == [(33, 4), (32, 4), (32, 4)]
    with pytest.raises(UnsupportedExportError, match=r"param 'o': cannot re-cut .* tp 4"):
        target_shard_maps({"o": params["o"]}, rules, 4, "s")


def test_target_maps_refusals() -> None:
    rules = _rules(
        wide=_split([10, 2], 0, [6, 4]),  # not near-even (grain-like)
        aff=_split([4, 2], 0, [2, 2], kind="affine"),
        vocab=_split([10, 2], 0, [5, 5], vocab_size=9, padded_vocab_size=10),
    )
    params = _entries(rules)
    cases = {
        "wide": r"param 'wide': .* widths \[6, 4\] of 10 are not the near-even split",
        "aff": r"param 'aff': .* records its pieces only",
        "vocab": r"param 'vocab': .* padded vocabulary \(10 rows for 9 tokens\)",
    }
    for name, message in cases.items():
        with pytest.raises(UnsupportedExportError, match=message):
            target_shard_maps({name: params[name]}, rules, 4, "s")
    with pytest.raises(UnsupportedExportError, match="s records no tensor-parallel split"):
        target_shard_maps(params, None, 2, "s")
    other = {"extra": SimpleNamespace(shape=[3])}
    with pytest.raises(UnsupportedExportError, match=r"param 'extra' \(shape \[3\]\).*does not"):
        target_shard_maps(other, rules, 2, "s")
    four = _rules(head=_split([97, 4], 0, [25, 24, 24, 24]))
    assert target_shard_maps(_entries(four), four, 2, "s")[1]["head"].shard_shape == (48, 4)
    with pytest.raises(UnsupportedExportError, match=r"uneven widths .* tp_grain_size 64"):
        target_shard_maps(_entries(four), four, 2, "s", grain=64)
    with pytest.raises(UnsupportedExportError, match=r"its widths \(tp_grain_size 64\)"):
        target_shard_maps(_entries(four), four, 3, "s", grain=64)
    assert target_shard_maps(_entries(four), four, 1, "s", grain=64)[0]["head"].runs


def test_tp_grain_size_from_config() -> None:
    assert tp_grain_size(None) == 1
    assert tp_grain_size({"tensor_parallel": {"autotp_size": 2}}) == 1
    assert tp_grain_size({"tensor_parallel": {"tp_grain_size": 64}}) == 64
    assert tp_grain_size({"tensor_parallel": {"tensor_parallel": {"tp_grain_size": 8}}}) == 8
