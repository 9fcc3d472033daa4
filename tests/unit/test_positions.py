"""Positions of a stage-0 optimizer state named from shapes and master digests (pure)."""

from __future__ import annotations

import pytest

from ucformat.errors import LayoutMismatchError, UnsupportedCheckpointError
from ucformat.layout.positions import Candidate, Slot, match_positions, segment_flat

#: The ``multi`` fixture model in module order.
MULTI = [
    Candidate("a.weight", (5, 7)),
    Candidate("a.bias", (5,)),
    Candidate("b.weight", (3, 5)),
    Candidate("b.bias", (3,)),
    Candidate("ln.weight", (3,)),
    Candidate("ln.bias", (3,)),
    Candidate("c.weight", (4, 3)),
    Candidate("c.bias", (4,)),
]


def _slots(groups: list[list[tuple[int, ...] | None]]) -> list[Slot]:
    out, position = [], 0
    for group, shapes in enumerate(groups):
        for shape in shapes:
            out.append(Slot(position, group, shape))
            position += 1
    return out


def test_module_order_single_group_with_repeated_shapes() -> None:
    names = [Candidate("fc1.w", (10, 10)), Candidate("fc1.b", (10,)),
             Candidate("fc2.w", (10, 10)), Candidate("fc2.b", (10,))]  # fmt: skip
    slots = _slots([[(10, 10), (10,), (10, 10), (10,)]])
    assert match_positions(slots, names, "x") == {0: "fc1.w", 1: "fc1.b", 2: "fc2.w", 3: "fc2.b"}


def test_two_groups_out_of_module_order_decided_by_shapes() -> None:
    # group 0: the weights reversed; group 1: the rest in module order, three of shape (3,)
    slots = _slots([[(4, 3), (3, 5), (5, 7)], [(5,), (3,), (3,), (3,), (4,)]])
    assert match_positions(slots, MULTI, "x") == {
        0: "c.weight", 1: "b.weight", 2: "a.weight",
        3: "a.bias", 4: "b.bias", 5: "ln.weight", 6: "ln.bias", 7: "c.bias",
    }  # fmt: skip


def test_same_shapes_in_a_group_out_of_module_order_are_refused() -> None:
    names = [Candidate("x", (2,)), Candidate("big", (9,)), Candidate("y", (2,))]
    slots = _slots([[(9,), (2,), (2,)]])  # 'big' listed before x: not module order
    with pytest.raises(UnsupportedCheckpointError, match="could each hold any of x, y"):
        match_positions(slots, names, "f")


def test_same_shapes_split_over_groups_are_refused_naming_them() -> None:
    names = [Candidate("p", (3,)), Candidate("q", (3,))]
    with pytest.raises(UnsupportedCheckpointError) as info:
        match_positions(_slots([[(3,)], [(3,)]]), names, "f.pt")
    message = str(info.value)
    assert message.startswith("f.pt: optimizer positions [0, 1] (groups 0, 1, shape [3]) ")
    assert "p, q" in message and "\n" not in message


def test_master_digests_decide_whatever_the_order() -> None:
    names = [Candidate("u", (2, 2), "ku"), Candidate("v", (2, 2), "kv")]
    slots = [Slot(0, 0, (2, 2), "kv"), Slot(1, 1, (2, 2), "ku")]
    assert match_positions(slots, names, "f") == {0: "v", 1: "u"}


def test_a_master_matching_no_weight_is_a_mismatch() -> None:
    with pytest.raises(LayoutMismatchError, match=r"position 0 .*fits no parameter"):
        match_positions([Slot(0, 0, (2,), "zz")], [Candidate("u", (2,), "ku")], "f")


def test_parameters_outside_the_optimizer_stay_unplaced() -> None:
    names = [Candidate("frozen", (4, 4)), Candidate("w", (4, 2))]
    assert match_positions(_slots([[(4, 2)]]), names, "f") == {0: "w"}


def test_stateless_positions_take_the_rest_in_module_order() -> None:
    names = [Candidate("a", (2,)), Candidate("f1", (3,)), Candidate("f2", (5,))]
    assert match_positions(_slots([[(2,), None, None]]), names, "f") == {0: "a", 1: "f1", 2: "f2"}


def test_flat_master_segmented_by_digests() -> None:
    values = {0: "k-b", 6: "k-a"}  # offset -> key of the parameter starting there
    names = [Candidate("a", (4,), "k-a"), Candidate("b", (2, 3), "k-b")]

    def key_at(offset: int, numel: int) -> str:
        return values[offset] if (offset, numel) in ((0, 6), (6, 4)) else "other"

    claimed: set[str] = set()
    assert segment_flat(0, 10, names, key_at, claimed, "f") == [("b", 0), ("a", 6)]
    assert claimed == {"a", "b"}
    with pytest.raises(LayoutMismatchError, match="group 0 at element 0"):
        segment_flat(0, 10, names, lambda offset, numel: "none", set(), "f")
