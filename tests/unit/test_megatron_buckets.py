"""Megatron's distributed-optimizer bucket layout (ucformat/layout/megatron_buckets.py) against
brute force, and the naming of Megatron checkpoint keys (ucformat/sources/megatron/keys.py).

The brute force lays a buffer out element by element, exactly as Megatron-Core 0.16.1's
``_ParamAndGradBuffer`` describes it (each parameter at the next multiple of 64 elements; a
bucket closed once it holds ``bucket_size`` elements, or around a ``shared_embedding``
parameter; every bucket padded to a multiple of ``lcm(dp, 128)``): the forward rule must agree
with it, and :func:`place_params` must recover every parameter's slot from the recorded sizes
alone.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucformat.errors import LayoutMismatchError
from ucformat.layout.boxes import chunk_runs
from ucformat.layout.megatron_buckets import (
    BucketParam,
    BucketSlot,
    bucket_sizes,
    cut_runs,
    local_runs,
    place_params,
)
from ucformat.sources.megatron.keys import parse_bucket_key, parse_state_key, parse_weight_key


def brute_force(
    params: list[BucketParam], bucket_size: int | None, dp: int
) -> tuple[list[BucketSlot], list[int], list[int]]:
    """The buffer as a list of owners (a parameter's index, or None for padding), then cut."""
    divisor = math.lcm(dp, 128)
    owners: list[int | None] = []
    starts = [0]
    unpadded: list[int] = []

    def close() -> None:
        unpadded.append(len(owners) - starts[-1])
        owners.extend([None] * (-len(owners) % divisor))
        starts.append(len(owners))

    for index, param in enumerate(params):
        owners.extend([None] * (-len(owners) % 64))
        if param.own_bucket and any(o is not None for o in owners[starts[-1] :]):
            close()
        owners.extend([index] * param.numel)
        if param.own_bucket or (
            bucket_size is not None and len(owners) - starts[-1] >= bucket_size
        ):
            close()
    if len(owners) > starts[-1]:
        close()
    slots = []
    for index, param in enumerate(params):
        first = owners.index(index)
        bucket = max(b for b, start in enumerate(starts[:-1]) if start <= first)
        slots.append(
            BucketSlot(bucket, first - starts[bucket], first - starts[bucket] + param.numel)
        )
    padded = [b - a for a, b in itertools.pairwise(starts)]
    return slots, unpadded, padded


params_strategy = st.lists(st.integers(1, 300).map(BucketParam), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    params=params_strategy,
    bucket_size=st.one_of(st.none(), st.integers(1, 1200)),
    dp=st.sampled_from([1, 2, 3, 4, 8]),
    shared=st.sets(st.integers(0, 11), max_size=2),
)
def test_forward_rule_matches_brute_force_and_inverts(
    params: list[BucketParam], bucket_size: int | None, dp: int, shared: set[int]
) -> None:
    params = [BucketParam(p.numel, i in shared) for i, p in enumerate(params)]
    slots, unpadded, padded = bucket_sizes(params, bucket_size, dp)
    assert (slots, unpadded, padded) == brute_force(params, bucket_size, dp)
    assert place_params(params, unpadded, padded) == slots


def test_real_layout_of_a_tied_pipeline_stage() -> None:
    """PP=2's last stage in the fixture (tests/fixtures/megatron_cases.py, pp2-uneven): the
    embedding's copy first (its own bucket), then the final norm and two layers."""
    layer = [1536, 3072, 32, 2048, 1024, 32]  # fc2, fc1, norm, qkv, proj, norm (reverse order)
    params = [BucketParam(2048, True), BucketParam(32), *map(BucketParam, layer * 2)]
    slots = place_params(params, [2048, 15648], [2048, 15744])
    assert slots[0] == BucketSlot(0, 0, 2048)
    assert slots[1] == BucketSlot(1, 0, 32)
    assert slots[2] == BucketSlot(1, 64, 64 + 1536)  # aligned to 64 elements
    assert slots[-1] == BucketSlot(1, 15616, 15648)


def test_sizes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(LayoutMismatchError, match="bucket 0 would close at parameter 1 after 160"):
        place_params([BucketParam(64), BucketParam(96)], [150], [256])
    with pytest.raises(LayoutMismatchError, match="fill 1 buckets; the checkpoint records 2"):
        place_params([BucketParam(64)], [64, 64], [128, 128])


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    data=st.data(),
)
def test_local_runs_map_local_elements_to_full_ones(shape: list[int], data: st.DataObject) -> None:
    """A local tensor of boxes (a TP shard, SwiGLU's two halves) against an explicit index map."""
    boxes = []
    for _ in range(data.draw(st.integers(1, 3))):
        offsets = [data.draw(st.integers(0, n - 1)) for n in shape]
        sizes = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets, strict=True)]
        boxes.append((offsets, sizes))
    expected: list[int] = []  # full flat index of every local element
    for offsets, sizes in boxes:
        for run in chunk_runs(tuple(shape), tuple(offsets), tuple(sizes)):
            expected.extend(range(run.start, run.start + run.length))
    runs = local_runs(shape, boxes)
    start = data.draw(st.integers(0, len(expected)))
    stop = data.draw(st.integers(start, len(expected)))
    got = [None] * (stop - start)
    for run in cut_runs(runs, start, stop):
        for i in range(run.length):
            got[run.chunk_start + i] = run.start + i
    assert got == expected[start:stop]


def test_weight_keys_are_named_by_the_contract() -> None:
    def names(key: str, shape: tuple[int, ...]) -> list[str]:
        weight = parse_weight_key(key, shape)
        return [weight.name(i) for i in weight.indices()]

    assert names("embedding.word_embeddings.weight", (64, 32)) == [
        "embedding.word_embeddings.weight"
    ]
    assert names("decoder.layers.mlp.linear_fc1.weight", (2, 96, 32)) == [
        "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc1.weight",
    ]  # fmt: skip
    experts = parse_weight_key("decoder.layers.mlp.experts.experts.linear_fc2.weight", (2, 3, 4, 5))
    assert experts.axes == ("layer", "expert") and experts.param_shape == (4, 5)
    assert experts.name((1, 2)) == "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"
    per_layer = parse_weight_key(
        "decoder.layers.7.mlp.experts.experts.linear_fc1.weight", (3, 4, 5)
    )
    assert per_layer.axes == ("expert",) and per_layer.name((2,)) == (
        "decoder.layers.7.mlp.experts.local_experts.2.linear_fc1.weight"
    )
    shared = parse_weight_key("decoder.layers.mlp.shared_experts.linear_fc1.weight", (2, 8, 4))
    assert shared.axes == ("layer",) and not shared.has_experts
    assert names("decoder.final_layernorm.weight", (32,)) == ["decoder.final_layernorm.weight"]


def test_optimizer_keys_are_recognised() -> None:
    state = parse_state_key("chained_1.optimizer.state.exp_avg.decoder.layers.mlp.router.weight")
    assert state is not None and (state.chained, state.state, state.weight) == (
        1, "exp_avg", "decoder.layers.mlp.router.weight",
    )  # fmt: skip
    assert parse_state_key("decoder.layers.mlp.router.weight") is None
    bucket = parse_bucket_key(
        "optimizer.distributed.dp_group_idx_3.gbuf_idx_1.dtype_(torch.bfloat16, torch.float32)"
        ".bucket_idx_2.exp_avg_sq"
    )
    assert bucket is not None
    assert (bucket.chained, bucket.group, bucket.buffer, bucket.bucket, bucket.state) == (
        None, 3, 1, 2, "exp_avg_sq",
    )  # fmt: skip


def test_te_grouped_experts_are_ordered_key_by_key() -> None:
    """TEGroupedMLP registers linear_fc1.weight<i> for every local expert, then linear_fc2."""
    from ucformat.sources.megatron.buckets import _key_major
    from ucformat.sources.megatron.params import order_params

    weights = [
        parse_weight_key("decoder.layers.mlp.router.weight", (2, 3, 8)),
        parse_weight_key("decoder.layers.mlp.experts.experts.linear_fc1.weight", (2, 3, 8, 8)),
        parse_weight_key("decoder.layers.mlp.experts.experts.linear_fc2.weight", (2, 3, 8, 8)),
    ]
    sequential = [slot.name.removeprefix("decoder.layers.") for slot in order_params(weights)]
    assert sequential[:4] == [
        "0.mlp.router.weight",
        "0.mlp.experts.local_experts.0.linear_fc1.weight",
        "0.mlp.experts.local_experts.0.linear_fc2.weight",
        "0.mlp.experts.local_experts.1.linear_fc1.weight",
    ]
    te = [slot.name.removeprefix("decoder.layers.") for slot in _key_major(order_params(weights))]
    assert te[:8] == [
        "0.mlp.router.weight",
        *(f"0.mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(3)),
        *(f"0.mlp.experts.local_experts.{e}.linear_fc2.weight" for e in range(3)),
        "1.mlp.router.weight",
    ]
