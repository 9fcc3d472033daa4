"""Logical arrays and the zarr arrays that hold them (docs/format.md §2.5).

A *logical array* is what the manifest names: one state of one parameter, or one buffer
(:class:`~ucformat.format.models.ArrayRef`). A *stored array* is one zarr array of the store
(:class:`StoredArray`): its path, geometry, codec and chunk-key separator, all a reader or
writer needs to find and decode its shard objects.

* Format 3.0 and older: every logical array is a stored array of its own, at
  ``params/<fqn>/<state>`` or ``buffers/<fqn>``, chunk keys separated by ``/``.
* Format 3.1: logical arrays of one layout (dtype, shape, chunk and shard shapes, compressor)
  are stacked on a new leading axis into one stored array at ``stacks/<n>``, chunk keys
  separated by ``.``. Index ``i`` of a stack of ``N`` arrays of shape ``(d_1, ..., d_n)`` is
  the stored array's ``[i]``: its flat elements ``[i * numel, (i + 1) * numel)``. The stored
  array has shape ``(N, d_1, ...)``, chunks ``(1, c_1, ...)`` (so every chunk holds elements of
  one logical array only, and a logical array's chunks are exactly its own) and shards
  ``(K, s_1, ...)``, ``K`` logical arrays per shard object.

Readers and writers work on stored arrays at flat offsets (:func:`placement`): a flat range
``[a, b)`` of a logical array is ``[offset + a, offset + b)`` of its stored array. Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ucformat.format.models import ArrayRef
from ucformat.format.spec import STACK_SEPARATOR, shard_object_key

__all__ = ["StoredArray", "describe_ref", "placement", "stored_array"]


@dataclass(frozen=True)
class StoredArray:
    """One zarr array of a store, as it is stored."""

    #: Path relative to the store root.
    path: str
    #: Logical dtype of every element (docs/format.md §2.3).
    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    compressor: str = "none"
    #: The chunk key separator: ``/`` (format 3.0 and older) or ``.`` (stacks).
    separator: str = "/"

    @property
    def numel(self) -> int:
        """Elements of the whole array."""
        return math.prod(self.shape)

    def shard_key(self, coords: tuple[int, ...]) -> str:
        """The store key of shard ``coords`` (docs/format.md §2.1)."""
        return shard_object_key(self.path, coords, self.separator)


def stored_array(ref: ArrayRef) -> StoredArray:
    """The zarr array holding the logical array ``ref``: the stack at ``ref.path`` (format 3.1),
    else the array at ``ref.path`` itself."""
    slot = ref.stack
    if slot is None:
        return StoredArray(
            ref.path, ref.dtype, tuple(ref.shape), tuple(ref.chunk_shape),
            tuple(ref.shard_shape), ref.compressor,
        )  # fmt: skip
    return StoredArray(
        ref.path,
        ref.dtype,
        (slot.size, *ref.shape),
        (1, *ref.chunk_shape),
        (slot.per_shard, *ref.shard_shape),
        ref.compressor,
        STACK_SEPARATOR,
    )


def placement(ref: ArrayRef) -> tuple[StoredArray, int]:
    """The stored array holding ``ref`` and the flat offset of ``ref``'s first element in it."""
    offset = 0 if ref.stack is None else ref.stack.index * math.prod(ref.shape)
    return stored_array(ref), offset


def describe_ref(ref: ArrayRef) -> str:
    """How messages name ``ref``'s array: its path, and its index for a stacked one
    (``stacks/3[4]``)."""
    return ref.path if ref.stack is None else f"{ref.path}[{ref.stack.index}]"
