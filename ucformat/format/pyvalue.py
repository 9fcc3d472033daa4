"""Lossless JSON encoding of the plain Python values found in training state.

Optimizer hyper-parameters, scheduler state and client state are mostly JSON already, but not
quite: ``betas`` is a tuple, a scheduler may hold ``inf``, a dict may have int keys. This codec
keeps them exact with a few tagged objects, so that ``decode(encode(x)) == x`` with the same
types::

    tuple            -> {"$tuple": [...]}
    int beyond ±(2**53 - 1)
                     -> {"$int": "<decimal digits>"}   (JSON numbers are doubles, §3.6)
    float nan/±inf   -> {"$float": "nan" | "inf" | "-inf"}
    dict, non-str keys (or a key starting with "$")
                     -> {"$dict": [[key, value], ...]}
    torch.dtype      -> {"$dtype": "bfloat16"}
    0-d torch tensor -> {"$scalar_tensor": {"dtype": "float32", "value": 4.0}}

Anything else (objects, non-scalar tensors, bytes) is not representable; :func:`encode` raises
:class:`NotRepresentable`, and callers record such values by key and type instead.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from ucformat.format.dtypes import dtype_name, torch_dtype
from ucformat.format.jcs import MAX_SAFE_INTEGER

__all__ = [
    "NotRepresentable", "Shown", "decode", "decode_for_display", "describe_type", "encode",
    "try_encode",
]  # fmt: skip

JSON = Any


class NotRepresentable(TypeError):
    """The value has no lossless JSON form; its type is in the message."""


def encode(value: Any) -> JSON:
    """Encode ``value`` as JSON-compatible data, exactly reversible by :func:`decode`."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if abs(value) > MAX_SAFE_INTEGER:
            return {"$int": str(int(value))}
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, tuple):
        return {"$tuple": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"$dict": [[encode(k), encode(v)] for k, v in value.items()]}
    torch = sys.modules.get("torch")  # a torch value exists only once torch is imported
    if torch is None:
        raise NotRepresentable(describe_type(value))
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return {"$scalar_tensor": {"dtype": dtype_name(value.dtype), "value": encode(value.item())}}
    raise NotRepresentable(describe_type(value))


def try_encode(value: Any) -> tuple[bool, JSON]:
    """Return ``(True, encoded)`` or ``(False, type description)``."""
    try:
        return True, encode(value)
    except NotRepresentable as exc:
        return False, str(exc)


def decode(data: JSON) -> Any:
    """Invert :func:`encode`."""
    return _decode(data, shown=False)


def decode_for_display(data: JSON) -> Any:
    """Like :func:`decode`, but dtypes and scalar tensors become :class:`Shown` text: no torch.

    For printing (``ucformat inspect``): ``str()`` of the result reads like the decoded value.
    """
    return _decode(data, shown=True)


class Shown(str):
    """Text that stands for a torch value in a displayed structure (its repr is the text)."""

    def __repr__(self) -> str:
        return str(self)


def _decode(data: JSON, *, shown: bool) -> Any:
    if isinstance(data, list):
        return [_decode(v, shown=shown) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "$tuple":
            return tuple(_decode(v, shown=shown) for v in body)
        if tag == "$float":
            return float(body)
        if tag == "$int":
            return int(body)
        if tag == "$dict":
            return {_hashable(_decode(k, shown=shown)): _decode(v, shown=shown) for k, v in body}
        if tag == "$dtype":
            return Shown(f"torch.{body}") if shown else torch_dtype(body)
        if tag == "$scalar_tensor":
            value = _decode(body["value"], shown=shown)
            if shown:
                return Shown(f"tensor({value!r}, dtype=torch.{body['dtype']})")
            import torch

            return torch.tensor(value, dtype=torch_dtype(body["dtype"]))
    return {k: _decode(v, shown=shown) for k, v in data.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def describe_type(value: Any) -> str:
    """A short type description of a value that cannot be encoded (``Tensor[float32, (3,)]``)."""
    torch = sys.modules.get("torch")
    is_tensor = torch is not None and isinstance(value, torch.Tensor)
    if is_tensor or (hasattr(value, "dtype") and hasattr(value, "shape")):
        dtype = value.dtype
        is_torch_dtype = torch is not None and isinstance(dtype, torch.dtype)
        name = dtype_name(dtype) if is_torch_dtype else str(dtype)
        return f"Tensor[{name}, {tuple(value.shape)}]"
    qualname = getattr(value, "ucformat_qualname", None)
    if qualname is not None:
        return str(qualname)
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}" if cls.__module__ != "builtins" else cls.__name__
