"""The one encoder of training-state values: client state kept in order, by type where it must."""

from __future__ import annotations

import pytest

from ucformat.errors import UCFormatError
from ucformat.format.training_values import NotStored, encode_client_state, encode_exact


def test_client_state_keeps_order_and_records_the_rest_by_type() -> None:
    state = encode_client_state(
        [("b", (1, 2)), (3, "three"), ("obj", object()), ("t", NotStored("tensor float32[2]"))]
    )
    assert list(state.values) == ["b", "3"]
    assert state.values == {"b": {"$tuple": [1, 2]}, "3": "three"}
    assert state.unrepresentable == {"obj": "object", "t": "tensor float32[2]"}


def test_a_later_key_replaces_the_earlier_in_place() -> None:
    state = encode_client_state([("a", 1), ("b", 2), ("a", 3)])
    assert list(state.values.items()) == [("a", 3), ("b", 2)]


def test_exact_state_refuses_in_one_line() -> None:
    assert encode_exact({"lr": float("inf")}, "lr_scheduler") == {"lr": {"$float": "inf"}}
    with pytest.raises(UCFormatError) as info:
        encode_exact({"fn": object()}, "lr_scheduler")
    assert str(info.value) == (
        "lr_scheduler: cannot be stored exactly (contains object); give a state whose values are "
        "numbers, strings, lists and dicts."
    )
