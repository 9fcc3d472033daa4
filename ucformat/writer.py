"""Execute a :class:`~ucformat.plan.ConvertPlan`: create the arrays, fill each shard once.

Each :class:`~ucformat.plan.WriteUnit` is assembled in one buffer of the shard's size, straight
from the source files (``pread`` into the buffer, no intermediate copies), then written with a
single zarr region write that covers the whole shard, so zarr never reads back. Units are
independent: they run on a thread pool here, and could run on many processes, each owning its
units. Peak memory is about ``workers x shard size``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zarr
from zarr.abc.store import Store

from ucformat.dtypes import numpy_storage_dtype, torch_to_storage
from ucformat.models import ArrayRef
from ucformat.plan import ConvertPlan, WriteUnit
from ucformat.zarr_io import create_array, write_region

__all__ = ["create_arrays", "fill_unit", "write_units"]

Progress = Callable[[int], None]


def create_arrays(store: Store, plan: ConvertPlan) -> list[zarr.Array[Any]]:
    """Create every array of ``plan`` (metadata only), in plan order."""
    return [create_array(store, ref) for ref in plan.arrays]


def fill_unit(ref: ArrayRef, unit: WriteUnit) -> np.ndarray:
    """The flat values of ``unit``'s shard (storage dtype), read from the source files."""
    buffer = np.zeros(unit.numel, dtype=numpy_storage_dtype(ref.dtype))
    for copy in unit.copies:
        target = buffer[copy.offset : copy.offset + copy.length]
        tensor = copy.fragment.tensor
        if tensor.is_contiguous():
            tensor.read_into(target, copy.tensor_start, copy.tensor_start + copy.length)
        else:
            whole = torch_to_storage(tensor.load()).reshape(-1)
            target[:] = whole[copy.tensor_start : copy.tensor_start + copy.length]
    return buffer


def write_units(
    plan: ConvertPlan,
    arrays: Sequence[zarr.Array[Any]],
    units: Sequence[WriteUnit],
    *,
    workers: int = 1,
    progress: Progress | None = None,
) -> None:
    """Fill and write ``units`` (any subset of ``plan.units``) into ``arrays``.

    Args:
        plan: the plan the units belong to.
        arrays: the opened arrays, indexed like ``plan.arrays``.
        units: the units this writer owns.
        workers: threads assembling and writing shards concurrently.
        progress: called with the bytes of each finished unit.
    """

    def run(unit: WriteUnit) -> int:
        buffer = fill_unit(plan.arrays[unit.array], unit)
        shape = tuple(s.stop - s.start for s in unit.region)
        write_region(arrays[unit.array], unit.region, buffer.reshape(shape))
        return buffer.nbytes

    if workers <= 1:
        for unit in units:
            done = run(unit)
            if progress is not None:
                progress(done)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for done in pool.map(run, units):
            if progress is not None:
                progress(done)
