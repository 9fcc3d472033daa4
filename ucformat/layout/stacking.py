"""Which logical arrays share a stack, and how many one shard object holds (docs/format.md §2.5).

Pure integer arithmetic over layouts; the planner (:mod:`ucformat.write.plan`) applies it.

* **Grouping.** Logical arrays of the same layout (dtype, shape, chunk and shard shapes,
  compressor) go into one stack, in plan order (parameters in module order, each parameter's
  states in order, then buffers), so a parameter's ``fp32``, ``exp_avg`` and ``exp_avg_sq``
  lie side by side, and the same weight of every layer (or every expert) shares one stack.
  A stack is cut after :data:`MAX_STACK_OBJECTS` shard objects, so no folder of a store
  holds more objects than that.
* **Arrays per shard** (:func:`arrays_per_shard`). A logical array of one chunk (at most
  ``chunk_bytes``: biases, norms, scalars) shares a shard object with the next arrays of its
  stack: as many as fit in ``shard_bytes``, at most :data:`MAX_INDEX_ENTRIES` (a reader of any
  one of them fetches the shard's whole index, 16 bytes per chunk), spread evenly. Their
  chunks then lie in the object in stack order, each array's one chunk one read. Any larger
  array keeps shards of its own (one logical array per object, byte for byte what format 3.0
  stored for it): several chunks of arrays sharing a shard would interleave in zarr's Morton
  order, and a read of one array would take a request per chunk.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

from ucformat.layout.partition import ceil_div

__all__ = ["MAX_INDEX_ENTRIES", "MAX_STACK_OBJECTS", "arrays_per_shard", "group_stacks"]

#: The most arrays (one chunk each) one shard object holds (a 4 KiB index).
MAX_INDEX_ENTRIES = 256
#: The most shard objects one stack holds (the objects of one folder of a local store).
MAX_STACK_OBJECTS = 4096


def arrays_per_shard(
    count: int,
    shape: Sequence[int],
    chunk_shape: Sequence[int],
    shard_shape: Sequence[int],
    itemsize: int,
    shard_bytes: int,
) -> int:
    """How many of a stack's ``count`` logical arrays of this layout one shard object holds.

    >>> arrays_per_shard(12, (768,), (768,), (768,), 4, 16 * 2**20)  # one chunk each
    12
    >>> arrays_per_shard(1000, (768,), (768,), (768,), 4, 16 * 2**20)  # 256 per index
    250
    >>> arrays_per_shard(3, (300, 64), (128, 64), (300, 64), 4, 16 * 2**20)  # 3 chunks each
    1
    """
    dims = tuple(shape)
    if count <= 1 or math.prod(dims) == 0:
        return 1
    if any(c < d for c, d in zip(chunk_shape, dims, strict=True)):
        return 1  # several chunks (or shards): the array's shards are objects of their own
    stored = math.prod(chunk_shape) * itemsize
    fit = min(count, shard_bytes // max(stored, 1), MAX_INDEX_ENTRIES)
    if fit <= 1:
        return 1
    return ceil_div(count, ceil_div(count, fit))  # as even as the count allows


def group_stacks(
    keys: Sequence[Hashable], objects: Sequence[int], per_shard: Sequence[int]
) -> list[list[int]]:
    """The stacks of logical arrays ``0 .. len(keys) - 1``: arrays of equal layout ``keys``,
    in order, cut so a stack holds at most :data:`MAX_STACK_OBJECTS` shard objects.

    Args:
        keys: each array's layout.
        objects: each array's shard objects when it is stored alone.
        per_shard: for each layout (the value at any of its arrays), the arrays per shard
            object of a full stack of them.

    >>> group_stacks(["a", "b", "a", "a"], [1, 1, 1, 1], [1, 1, 1, 1])
    [[0, 2, 3], [1]]
    """
    stacks: list[list[int]] = []
    open_stack: dict[Hashable, int] = {}
    for index, key in enumerate(keys):
        at = open_stack.get(key)
        if at is not None:
            members = stacks[at]
            size = len(members) + 1
            if ceil_div(size, per_shard[index]) * objects[index] <= MAX_STACK_OBJECTS:
                members.append(index)
                continue
        open_stack[key] = len(stacks)
        stacks.append([index])
    return stacks
