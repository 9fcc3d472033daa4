"""ZeRO partition math against the worked examples of the DeepSpeed reference (plain numbers)."""

from __future__ import annotations

import pytest

from ucformat.layout.partition import (
    Fragment,
    PartitionedFlatLayout,
    PerParamLayout,
    alignment_paddings,
    zero3_sub_groups,
)

LINEARS = [("l0.w", 100), ("l0.b", 10), ("l1.w", 100), ("l1.b", 10)]


def spans(layout: PartitionedFlatLayout | PerParamLayout, rank: int) -> list[tuple[str, int, int]]:
    return [(f.name, f.partition_start, f.length) for f in layout.fragments(rank)]


@pytest.mark.parametrize(
    ("world_size", "total", "partition"), [(2, 220, 110), (3, 222, 74), (4, 224, 56)]
)
def test_zero12_sizes_example_a(world_size: int, total: int, partition: int) -> None:
    layout = PartitionedFlatLayout.build(LINEARS, world_size)
    assert (layout.total, layout.partition_size) == (total, partition)


def test_zero12_fragments_example_a_ws4() -> None:
    layout = PartitionedFlatLayout.build(LINEARS, 4)
    assert spans(layout, 0) == [("l0.w", 0, 56)]
    assert spans(layout, 1) == [("l0.w", 0, 44), ("l0.b", 44, 10), ("l1.w", 54, 2)]
    assert spans(layout, 2) == [("l1.w", 0, 56)]
    assert spans(layout, 3) == [("l1.w", 0, 42), ("l1.b", 42, 10)]
    assert [layout.valid_length(r) for r in range(4)] == [56, 56, 56, 52]
    first = next(layout.fragments(1))
    assert first == Fragment("l0.w", 1, 56, 0, 44)


def test_zero12_fragments_example_a_ws3() -> None:
    layout = PartitionedFlatLayout.build(LINEARS, 3)
    assert spans(layout, 1) == [("l0.w", 0, 26), ("l0.b", 26, 10), ("l1.w", 36, 38)]
    assert [layout.valid_length(r) for r in range(3)] == [74, 74, 72]


def test_zero12_rank_of_pure_padding_example_b() -> None:
    group1 = [("a.bias", 5), ("b.bias", 3), ("ln.weight", 3), ("ln.bias", 3), ("c.bias", 4)]
    layout = PartitionedFlatLayout.build(group1, 4)
    assert (layout.total, layout.partition_size) == (24, 6)
    assert list(layout.fragments(3)) == []
    assert layout.valid_length(3) == 0


def test_alignment_paddings_match_reference() -> None:
    assert alignment_paddings([5, 3, 3, 3, 4], element_size=4) == [3, 1, 1, 1, 0]
    assert alignment_paddings([12, 15, 35], element_size=2) == [4, 1, 0]
    assert alignment_paddings([5, 3, 3, 3, 4], element_size=2) == [3, 5, 5, 5, 0]
    layout = PartitionedFlatLayout.build(
        [("a", 5), ("b", 3), ("c", 3), ("d", 3), ("e", 4)], 2, [3, 1, 1, 1, 0]
    )
    assert [s.offset for s in layout.slots] == [0, 8, 12, 16, 20]
    assert layout.used == 24


def test_zero3_pieces_example() -> None:
    layout = PerParamLayout.build(LINEARS, 3)
    assert layout.partition_size == 76
    assert spans(layout, 2) == [("l0.w", 0, 32), ("l0.b", 34, 2), ("l1.w", 38, 32), ("l1.b", 72, 2)]
    assert [f.param_start for f in layout.fragments(2)] == [68, 8, 68, 8]


def test_zero3_rank_with_only_padding() -> None:
    layout = PerParamLayout.build([("p", 4)], 3)
    assert [list(layout.fragments(r)) for r in range(3)][2] == []
    assert spans(layout, 1) == [("p", 0, 2)]


def test_zero3_sub_groups_change_with_world_size() -> None:
    group0 = [("c.weight", 12), ("b.weight", 15), ("a.weight", 35)]
    assert zero3_sub_groups(group0, 2, 12) == [["c.weight", "b.weight"], ["a.weight"]]
    assert zero3_sub_groups(group0, 3, 12) == [["c.weight", "b.weight", "a.weight"]]
    assert zero3_sub_groups(group0, 2, 10**9) == [["c.weight", "b.weight", "a.weight"]]


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size"):
        PartitionedFlatLayout.build(LINEARS, 0)
