"""Execute a :class:`~ucformat.write.plan.ConvertPlan`: create the arrays, fill each shard once.

Each :class:`~ucformat.write.plan.WriteUnit` (one shard) is filled straight from the source files
and
stored as one object. Units are independent: they run on a thread pool here, and could run on
many processes, each owning its units.

Uncompressed shards (the default) are encoded by :mod:`ucformat.write.shard_encode`, not by
zarr: on a local store each worker streams the shard object into its (temporary, then renamed) file
through one small reused buffer, so memory is about ``workers x 512 KiB`` whatever the shard
size; on any other store the whole object is built in one buffer and stored with one ``set``
(``workers x shard size``). ``zstd`` shards go through zarr's codec pipeline (:func:`fill_unit`,
then one region write).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ucformat.format.dtypes import itemsize, numpy_storage_dtype, torch_to_storage
from ucformat.format.stacks import StoredArray
from ucformat.store.arrays import Array, write_region, write_shard
from ucformat.store.arrays import create_arrays as create_array_group
from ucformat.store.direct.objects import local_object
from ucformat.store.keys import Store
from ucformat.write.plan import ConvertPlan, WriteUnit
from ucformat.write.shard_encode import WINDOW_BYTES, encode_shard, shard_of, stream_shard

__all__ = ["DEFAULT_WORKERS", "create_arrays", "fill_unit", "write_units"]

#: Shard writers run concurrently by default: reading, checksumming and writing overlap, and
#: memory stays bounded (see the module docstring).
DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))

Progress = Callable[[int], None]


def create_arrays(store: Store, plan: ConvertPlan) -> list[Array]:
    """Create every array of ``plan`` (metadata only), in plan order."""
    return create_array_group(store, plan.arrays)


def fill_unit(ref: StoredArray, unit: WriteUnit) -> np.ndarray:
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
    arrays: Sequence[Array],
    units: Sequence[WriteUnit],
    *,
    workers: int = DEFAULT_WORKERS,
    progress: Progress | None = None,
    writeback: bool = False,
) -> None:
    """Fill and write ``units`` (any subset of ``plan.units``) into ``arrays``.

    Args:
        plan: the plan the units belong to.
        arrays: the opened arrays, indexed like ``plan.arrays``.
        units: the units this writer owns.
        workers: threads assembling and writing shards concurrently.
        progress: called with the bytes of each finished unit.
        writeback: start the disk writes of each local shard file as soon as it is written
            (``posix_fadvise(DONTNEED)``, which does not wait), so that the fsync before the
            commit finds little left to write; for durable writes only.
    """

    scratch = threading.local()

    def run(unit: WriteUnit) -> int:
        ref, array = plan.arrays[unit.array], arrays[unit.array]
        if ref.compressor == "none" and ref.shape:
            key = ref.shard_key(shard_of(ref, unit))
            with local_object(array.store_path.store, key) as fd:
                if fd is not None:
                    if not hasattr(scratch, "window"):  # one per worker, reused for every shard
                        scratch.window = memoryview(bytearray(WINDOW_BYTES))
                    stream_shard(fd, ref, unit, scratch.window)
                    if writeback and hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    return unit.numel * itemsize(ref.dtype)
            shard, encoded = encode_shard(ref, unit)
            write_shard(array, shard, encoded)
            return unit.numel * itemsize(ref.dtype)
        buffer = fill_unit(ref, unit)
        shape = tuple(s.stop - s.start for s in unit.region)
        write_region(array, unit.region, buffer.reshape(shape))
        return buffer.nbytes

    if workers <= 1:
        for unit in units:
            done = run(unit)
            if progress is not None:
                progress(done)
        return
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        for done in pool.map(run, units):
            if progress is not None:
                progress(done)
    finally:  # on an error or Ctrl-C: drop queued units, wait for those in flight (no write
        pool.shutdown(wait=True, cancel_futures=True)  # may land after the caller's cleanup)
