"""Exact JSON round trip of training-state values."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ucformat.format.pyvalue import NotRepresentable, decode, encode, try_encode


@pytest.mark.parametrize(
    "value",
    [
        None, True, 3, 2.5, "x", [1, (2, 3)], {"betas": (0.9, 0.999), "eps": 1e-8},
        {1: "int key", "$x": 2}, float("inf"), -float("inf"), torch.float16,
        {"nested": [{"a": (1, [2, {3: 4}])}]},
    ],
)  # fmt: skip
def test_round_trip_keeps_types(value: object) -> None:
    encoded = json.loads(json.dumps(encode(value), allow_nan=False))
    decoded = decode(encoded)
    assert decoded == value
    assert type(decoded) is type(value)


def test_nan_and_scalar_tensor() -> None:
    assert math.isnan(decode(encode(float("nan"))))
    tensor = decode(encode(torch.tensor(4.0)))
    assert tensor.dtype == torch.float32 and tensor.item() == 4.0 and tensor.dim() == 0


def test_unrepresentable_values_are_described() -> None:
    with pytest.raises(NotRepresentable, match=r"Tensor\[float32, \(3,\)\]"):
        encode(torch.zeros(3))
    assert try_encode(object()) == (False, "object")
    assert try_encode(b"bytes") == (False, "bytes")
