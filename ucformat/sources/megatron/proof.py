"""The proof that an optimizer's fp32 main params are the model's weights.

A mixed-precision or distributed optimizer keeps fp32 *main params* beside the model's weights;
after every step Megatron copies them into the weights (cast to the weights' dtype). So in any
checkpoint Megatron saved, each parameter's main param equals its weight (fp32 weights) or
rounds to it exactly (bf16, fp16: round to nearest even). ucformat checks this for every
parameter whose master it took from anywhere but the weight itself: a ``dp_reshardable`` bucket
range rebuilt by :mod:`.buckets` that is off by one element, or a ``fully_reshardable`` state
Megatron wrote wrong, fails here, and the conversion stops in one line naming the first
parameter that does not match, before anything is written.

The check reads every master and weight once (numpy, storage dtypes; no torch).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ucformat.errors import UnsupportedCheckpointError
from ucformat.format.dtypes import numpy_storage_dtype
from ucformat.sources.base import ArraySource

__all__ = ["check_masters", "materialize", "rounds_to"]


def materialize(array: ArraySource) -> np.ndarray:
    """The array's flat elements (storage dtype: bfloat16 as uint16), read from its fragments."""
    out = np.zeros(array.numel, dtype=numpy_storage_dtype(array.dtype))
    for fragment in array.fragments:
        stop = fragment.start + fragment.length
        fragment.tensor.read_into(
            out[fragment.start : stop],
            fragment.tensor_start,
            fragment.tensor_start + fragment.length,
        )
    return out


def rounds_to(master: np.ndarray, weight: np.ndarray, weight_dtype: str) -> int | None:
    """The first flat index where fp32 ``master`` does not round to ``weight`` (storage dtype of
    ``weight_dtype``), None if every element does. NaN matches NaN."""
    bits = master.view(np.uint32)
    if weight_dtype == "float32":
        same = bits == weight.view(np.uint32)
    elif weight_dtype == "bfloat16":
        wide = bits.astype(np.uint64)
        rounded = ((wide + 0x7FFF + ((wide >> 16) & 1)) >> 16).astype(np.uint16)
        same = rounded == weight.view(np.uint16)
    elif weight_dtype == "float16":
        same = master.astype(np.float16).view(np.uint16) == weight.view(np.uint16)
    else:
        return 0
    if weight_dtype == "float32":
        both_nan = np.isnan(master) & np.isnan(weight.view(np.float32))
    elif weight_dtype == "float16":
        both_nan = np.isnan(master) & np.isnan(weight.view(np.float16))
    else:
        both_nan = np.isnan(master) & ((weight.view(np.uint16) & 0x7FFF) > 0x7F80)
    bad = np.flatnonzero(~(same | both_nan))
    return int(bad[0]) if bad.size else None


def check_masters(
    folder: str, pairs: Iterable[tuple[str, ArraySource, ArraySource]], how: str
) -> int:
    """Check ``(name, master, weight)`` for every parameter; return how many were checked.

    Raises:
        UnsupportedCheckpointError: the first parameter whose master does not match its weight.
    """
    count = 0
    for name, master, weight in pairs:
        if master.shape != weight.shape:
            raise UnsupportedCheckpointError(
                f"{folder}: the fp32 main param of '{name}' has shape {list(master.shape)}, the "
                f"weight {list(weight.shape)}; {how}"
            )
        index = rounds_to(materialize(master), materialize(weight), weight.dtype)
        if index is not None:
            raise UnsupportedCheckpointError(
                f"{folder}: the fp32 main param of '{name}' does not round to its "
                f"{weight.dtype} weight (first at flat element {index}); {how}"
            )
        count += 1
    return count
