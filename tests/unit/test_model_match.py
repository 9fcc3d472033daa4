"""The one model-vs-store match: names and shapes compared, one refusal in one shape."""

from __future__ import annotations

import pytest

from ucformat.errors import ModelMismatchError
from ucformat.read.model_match import ModelMatch, match_model, refuse_mismatch

STORE = {"a": [4, 8], "b": [8], "tied": [2]}


def test_names_and_shapes_are_compared_through_aliases() -> None:
    match = match_model(
        {"a": (4, 8), "b": (9,), "c": (1,), "alias": (2,)},
        STORE,
        resolve=lambda n: "tied" if n == "alias" else n,
    )
    assert match == ModelMatch(missing=["c"], unexpected=[], shapes=["b (model [9], store [8])"])


def test_names_held_elsewhere_are_not_unexpected() -> None:
    assert match_model({"a": [4, 8]}, STORE, not_here={"b"}).unexpected == ["tied"]


def test_strict_refuses_names_in_one_line() -> None:
    match = match_model({"a": [4, 8], "c": [1]}, STORE)
    with pytest.raises(ModelMismatchError) as info:
        refuse_mismatch(match, strict=True, also=["buffers missing from the store: bn"])
    assert str(info.value) == (
        "the model does not match the checkpoint: missing from the store: c; not in the model: "
        "b, tied; buffers missing from the store: bn. Nothing was loaded; fix the model, or pass "
        "strict=False to load the matching parameters only."
    )
    assert refuse_mismatch(match, strict=False) == [
        "missing from the store: c", "not in the model: b, tied"
    ]  # fmt: skip


def test_a_shape_is_refused_even_without_strict() -> None:
    match = match_model({"a": [4, 16]}, {"a": [4, 8]}, label="buffer ")
    with pytest.raises(ModelMismatchError) as info:
        refuse_mismatch(match, strict=False)
    assert str(info.value) == (
        "the model does not match the checkpoint: different shapes: buffer a (model [4, 16], "
        "store [4, 8]). Nothing was loaded; fix the model (a shape that differs is refused even "
        "with strict=False)."
    )


def test_matches_add_up_in_order() -> None:
    one, two = ModelMatch(["x"], ["y"], []), ModelMatch(["b"], [], ["s"])
    assert one + two == ModelMatch(["x", "b"], ["y"], ["s"])
    assert refuse_mismatch(ModelMatch(), strict=True) == []
