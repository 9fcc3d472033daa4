"""A GroupedMLP expert's slice of a bucket, seen transposed: the fragment tensor of one expert.

Megatron's legacy ``GroupedMLP`` keeps all of a rank's experts in two parameters: ``weight1`` of
shape ``(hidden, experts * fc1 rows)``, read as ``(experts, hidden, fc1 rows)``, and ``weight2``
of shape ``(experts * fc2 columns, hidden)``, read as ``(experts, fc2 columns, hidden)``; expert
``e``'s ``linear_fc1`` (``linear_fc2``) weight is the transpose of its block (Megatron's own
``sharded_state_dict`` saves the weights so). The distributed optimizer keeps these parameters
flat in its buckets, so an expert's master and moments there are a transposed block, not a box
of the expert's parameter.

:class:`TransposedBlock` is that block as a fragment tensor: the local elements
``[base, base + rows * cols)`` of such a parameter (gathered from the bucket chunks that hold
them), laid out ``(cols, rows)``, presented row-major as ``(rows, cols)``. It is not contiguous
(the writer loads it whole: one expert's local slice). The last block read is kept (one per
process), so reading a block run by run reads its bytes once, and memory stays one block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ucformat.format.dtypes import numpy_storage_dtype, storage_to_torch
from ucformat.sources.torchfile import TensorRef

if TYPE_CHECKING:
    import torch

__all__ = ["Piece", "TransposedBlock"]


@dataclass(frozen=True)
class Piece:
    """Local elements ``[start, start + length)`` are ``tensor[tensor_start:]``."""

    tensor: TensorRef
    tensor_start: int
    start: int
    length: int


class TransposedBlock:
    """See the module docstring."""

    #: The last block read: (block, its elements).
    _last: tuple[TransposedBlock, np.ndarray] | None = None

    def __init__(
        self, pieces: Sequence[Piece], base: int, rows: int, cols: int, dtype_name: str
    ) -> None:
        self.pieces, self.base, self.rows, self.cols = list(pieces), base, rows, cols
        self._dtype = dtype_name

    @property
    def dtype_name(self) -> str:
        """The manifest's name of the elements' dtype."""
        return self._dtype

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)``."""
        return (self.rows, self.cols)

    def is_contiguous(self) -> bool:
        """Never: the elements are a transposed block of the source."""
        return False

    def _flat(self) -> np.ndarray:
        """The ``(rows, cols)`` row-major elements (storage dtype), read once."""
        last = TransposedBlock._last
        if last is not None and last[0] is self:
            return last[1]
        count = self.rows * self.cols
        block = np.zeros(count, dtype=numpy_storage_dtype(self._dtype))
        filled = 0
        for piece in self.pieces:
            low = max(piece.start, self.base)
            high = min(piece.start + piece.length, self.base + count)
            if low < high:
                first = piece.tensor_start + low - piece.start
                target = block[low - self.base : high - self.base]
                piece.tensor.read_into(target, first, first + high - low)
                filled += high - low
        if filled != count:
            raise ValueError(f"the bucket chunks cover {filled} of {count} elements")
        values = np.ascontiguousarray(block.reshape(self.cols, self.rows).T).reshape(-1)
        TransposedBlock._last = (self, values)
        return values

    def read_into(self, out: np.ndarray, start: int, stop: int) -> None:
        """Copy elements ``[start, stop)`` (row-major ``(rows, cols)``) into ``out``."""
        out[:] = self._flat()[start:stop]

    def read_scattered(self, start: int, views: Sequence[memoryview]) -> None:
        """Copy elements from ``start`` on into the byte ``views``, one after another."""
        data = self._flat().data.cast("B")
        at = start * self._flat().itemsize
        for view in views:
            view[:] = data[at : at + len(view)]
            at += len(view)

    def load(self) -> torch.Tensor:
        """The whole ``(rows, cols)`` tensor."""
        return storage_to_torch(self._flat().copy(), self._dtype).reshape(self.rows, self.cols)
