"""Execute a :class:`~ucformat.plan.ConvertPlan`: create the arrays, fill each shard once.

Each :class:`~ucformat.plan.WriteUnit` (one shard) is assembled in one buffer, straight from the
source files, and stored as one object. Units are independent: they run on a thread pool here,
and could run on many processes, each owning its units. Peak memory is about
``workers x shard size``.

Uncompressed shards (the default) are encoded here, not by zarr: the buffer is the shard object
itself (:mod:`ucformat.layout.shards`: chunks in zarr's order, each followed by its crc32c, then
the index). ``preadv`` scatters each source fragment directly into the chunks it fills (one copy,
from the page cache), every chunk's crc32c is computed in place, and the buffer is written with
one store ``set``. The bytes are exactly those zarr writes for the same region
(``tests/integration/test_shard_encoding.py``); zarr's per-chunk encode (a Python coroutine, a copy for
the checksum and one for the shard per chunk) is what this avoids. ``zstd`` shards go through
zarr's codec pipeline (:func:`fill_unit`, then one region write).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import crc32c
import numpy as np
import zarr
from zarr.abc.store import Store

from ucformat.dtypes import itemsize, numpy_storage_dtype, torch_to_storage
from ucformat.layout.shards import ABSENT, CRC_BYTES, shard_layout
from ucformat.models import ArrayRef
from ucformat.plan import ConvertPlan, WriteUnit
from ucformat.zarr_io import create_arrays as create_array_group
from ucformat.zarr_io import write_region, write_shard

__all__ = ["DEFAULT_WORKERS", "create_arrays", "encode_shard", "fill_unit", "write_units"]

#: Shard writers run concurrently by default: reading, checksumming and writing overlap, and
#: memory stays bounded by ``workers x shard size``.
DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))

Progress = Callable[[int], None]


def create_arrays(store: Store, plan: ConvertPlan) -> list[zarr.Array[Any]]:
    """Create every array of ``plan`` (metadata only), in plan order."""
    return create_array_group(store, plan.arrays)


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


def encode_shard(ref: ArrayRef, unit: WriteUnit) -> tuple[tuple[int, ...], np.ndarray]:
    """The shard coordinates of ``unit`` and its whole stored object (uncompressed), as bytes.

    Raises:
        ValueError: the array is 0-d, compressed, or its chunks are not flat-contiguous.
    """
    if ref.compressor != "none" or not ref.shape:
        raise ValueError(f"{ref.path}: only uncompressed n-d shards are encoded here")
    item = itemsize(ref.dtype)
    shard = tuple(piece.start // size for piece, size in zip(unit.region, ref.shard_shape,
                                                              strict=True))  # fmt: skip
    layout = shard_layout(ref.shape, ref.chunk_shape, ref.shard_shape, item, shard)
    slots = sorted(layout.slots, key=lambda slot: slot.flat_start)
    if sum(slot.length for slot in slots) != unit.numel or slots[0].flat_start != unit.flat_start:
        raise ValueError(f"{ref.path}: shard {shard} is not one flat range of chunks")
    buffer = np.zeros(layout.nbytes, dtype=np.uint8)  # chunk padding is the fill value 0
    view = memoryview(buffer)
    starts = [slot.flat_start for slot in slots]
    for copy in unit.copies:
        low = unit.flat_start + copy.offset
        high = low + copy.length
        targets: list[memoryview] = []
        index = bisect.bisect_right(starts, low) - 1
        while low < high:
            slot = slots[index]
            stop = min(high, slot.flat_start + slot.length)
            first = slot.offset + (low - slot.flat_start) * item
            targets.append(view[first : first + (stop - low) * item])
            low, index = stop, index + 1
        tensor = copy.fragment.tensor
        if tensor.is_contiguous():
            tensor.read_scattered(copy.tensor_start, targets)
        else:
            whole = torch_to_storage(tensor.load()).reshape(-1)
            values = memoryview(whole[copy.tensor_start : copy.tensor_start + copy.length])
            values, done = values.cast("B"), 0
            for target in targets:
                target[:] = values[done : done + len(target)]
                done += len(target)
    entries = np.full((*layout.chunks_per_shard, 2), ABSENT, dtype="<u8")
    stored = layout.chunk_nbytes + CRC_BYTES
    for slot in layout.slots:
        end = slot.offset + layout.chunk_nbytes
        buffer[end : end + CRC_BYTES] = np.frombuffer(
            crc32c.crc32c(view[slot.offset : end]).to_bytes(4, "little"), dtype=np.uint8
        )
        entries[slot.local] = (slot.offset, stored)
    index_bytes = entries.tobytes()
    at = layout.index_offset
    buffer[at : at + len(index_bytes)] = np.frombuffer(index_bytes, dtype=np.uint8)
    buffer[at + len(index_bytes) :] = np.frombuffer(
        crc32c.crc32c(index_bytes).to_bytes(4, "little"), dtype=np.uint8
    )
    return shard, buffer


def write_units(
    plan: ConvertPlan,
    arrays: Sequence[zarr.Array[Any]],
    units: Sequence[WriteUnit],
    *,
    workers: int = DEFAULT_WORKERS,
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
        ref = plan.arrays[unit.array]
        if ref.compressor == "none" and ref.shape:
            shard, encoded = encode_shard(ref, unit)
            write_shard(arrays[unit.array], shard, encoded)
            return unit.numel * itemsize(ref.dtype)
        buffer = fill_unit(ref, unit)
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
