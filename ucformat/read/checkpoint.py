"""``ucformat.open``: a committed store, read lazily by parameter, state and flat range.

A flat range ``[start, stop)`` of a parameter is widened to whole chunks. Uncompressed stores
are read straight from the shard objects (:mod:`ucformat.store.direct.shard_read`: the shard
index, then one range request per run of chunks, every crc32c checked); otherwise, or when
any check fails, the range maps to at most ``2 * ndim - 1`` boxes of its array
(:func:`~ucformat.layout.ranges.flat_range_to_boxes`) read through zarr, which fetches only the
inner chunks those boxes touch and names any bad chunk. Either way the same bytes are fetched,
and every byte is counted in :attr:`UniversalCheckpoint.stats`.

Every read goes to the zarr array that holds the logical array
(:func:`~ucformat.format.stacks.placement`): in a format-3.1 store a stack, where the logical
array's flat range ``[a, b)`` is ``[offset + a, offset + b)`` and its chunks are its own; in an
older store the array itself, at offset 0.

A DTensor's local shard that is not one flat range (a ``Shard(1)`` column block: one run per
row) is read by :meth:`UniversalCheckpoint.read_runs`. With flat-contiguous chunks the runs'
chunk-widened spans that overlap or touch are merged
(:func:`~ucformat.layout.placements.merge_runs`) and each merged span is one range read; with
box chunks (docs/format.md §2.2) all runs are one read of exactly the chunks holding them
(:mod:`ucformat.store.direct.runs_read`). Either way every chunk is fetched once. Through zarr,
box-chunked arrays are read as the disjoint chunk-aligned boxes holding those chunks
(:func:`~ucformat.layout.ranges.chunk_cover`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ucformat.collective import Group, share_read
from ucformat.errors import OutOfRangeError, ParamNotFoundError
from ucformat.format.dtypes import numpy_storage_dtype, storage_to_torch, torch_dtype
from ucformat.format.models import ArrayRef, CheckpointManifest, ScalarState
from ucformat.format.spec import (
    BUFFER_STATE,
    FP32_STATE,
    MANIFEST_KEY,
    STACK_SEPARATOR,
    VALUE_STATE,
)
from ucformat.format.stacks import StoredArray, describe_ref, placement
from ucformat.layout.boxes import Run
from ucformat.layout.chunking import chunk_aligned_range, is_flat_chunking
from ucformat.layout.placements import merge_runs
from ucformat.layout.ranges import chunk_cover, flat_range_to_boxes, intersect_boxes
from ucformat.read.staging import host_buffer
from ucformat.store.arrays import Array, array_from_manifest, read_box
from ucformat.store.checked import CheckedStore, IOStats
from ucformat.store.direct.runs_read import FlatRun, check_runs, read_runs
from ucformat.store.direct.shard_read import NOT_APPLICABLE
from ucformat.store.keys import Store, StoreLike, open_store
from ucformat.store.manifest_io import parse_manifest, read_manifest, read_manifest_bytes
from ucformat.sysio.memory import prefaulted_empty

__all__ = ["BUFFER_STATE", "UniversalCheckpoint", "open_checkpoint", "scalar_value"]


def open_checkpoint(store: StoreLike, group: Group | None = None) -> UniversalCheckpoint:
    """Open a committed ucformat store for reading.

    Args:
        store: a local path, an fsspec URL, or a zarr ``Store``.
        group: the ranks of a collective load (:func:`ucformat.collective.group`, every rank
            calling): its first rank reads the manifest and sends the bytes to the others, so
            storage serves it once per job; every rank validates it. None: this rank reads it.

    Raises:
        IncompleteStoreError: the store has no committed manifest.
        UnsupportedVersionError: the store is from a newer format major version.
        ManifestError: the manifest is damaged, invalid or edited.

    Example:
        >>> ckpt = ucformat.open("ckpt.ucf")  # doctest: +SKIP
        >>> ckpt.read("layers.0.weight", "exp_avg").shape  # doctest: +SKIP
        torch.Size([10, 10])
    """
    where = str(store)
    if group is None or not group.distributed:
        checked = CheckedStore(open_store(store, read_only=True))
        return UniversalCheckpoint(checked, read_manifest(checked, where), where)
    opened: CheckedStore | Exception
    try:  # a rank that cannot open its store still takes part in the broadcast
        opened = CheckedStore(open_store(store, read_only=True))
    except Exception as exc:
        opened = exc

    def read_first() -> bytes:
        if isinstance(opened, Exception):
            raise opened
        return read_manifest_bytes(opened, where)

    payload = share_read(read_first, group, MANIFEST_KEY)
    if isinstance(opened, Exception):
        raise opened
    if payload is None:  # the first rank could not read it: each rank reads its own
        return UniversalCheckpoint(opened, read_manifest(opened, where), where)
    return UniversalCheckpoint(opened, parse_manifest(payload, where), where)


def scalar_value(scalar: ScalarState) -> Any:
    """The Python value of a scalar state, with its original type (0-d tensor, int, float)."""
    if scalar.kind == "tensor":
        return torch.tensor(scalar.value, dtype=torch_dtype(scalar.dtype or "float32"))
    if scalar.kind == "int":
        return int(scalar.value)
    if scalar.kind == "bool":
        return bool(scalar.value)
    return float(scalar.value)


class UniversalCheckpoint:
    """A committed ucformat store opened for reading."""

    def __init__(self, store: CheckedStore, manifest: CheckpointManifest, where: str) -> None:
        self.store: Store = store
        self.manifest = manifest
        self.where = where
        self.stats: IOStats = store.stats
        self._arrays: dict[str, Array] = {}
        self._lock = threading.Lock()
        self._names: dict[tuple[str, int], str] | None = None

    def __repr__(self) -> str:
        source = self.manifest.source
        what = (
            f"ZeRO-{source.zero_stage} x{source.world_size} {source.train_dtype}"
            if source.framework == "deepspeed"
            else source.describe()
        )
        return f"<UniversalCheckpoint {self.where}: {len(self.manifest.params)} params, {what}>"

    # --- lookup -------------------------------------------------------------------------------
    def array_ref(self, name: str, state: str) -> ArrayRef:
        """The array holding ``state`` of parameter (or buffer) ``name``."""
        if state == BUFFER_STATE:
            buffer = self.manifest.buffers.get(name)
            if buffer is None:
                raise ParamNotFoundError(
                    f"'{name}' is not a buffer of this checkpoint "
                    f"({len(self.manifest.buffers)} buffers; see 'ucformat inspect')."
                )
            return buffer.array
        entry = self.manifest.params.get(self.manifest.resolve(name))
        if entry is None:
            raise ParamNotFoundError(
                f"'{name}' is not a parameter of this checkpoint "
                f"({len(self.manifest.params)} params; see 'ucformat inspect')."
            )
        ref = entry.states.get(state) or entry.whole_states.get(state)  # whole: format 3.1
        if ref is None and state == FP32_STATE and not entry.requires_grad:
            ref = entry.states.get(VALUE_STATE)  # a frozen parameter's value (format 2)
        if ref is None:
            available = sorted([*entry.states, *entry.whole_states, *entry.scalars])
            raise ParamNotFoundError(
                f"parameter '{name}' has no state '{state}'; it has {', '.join(available)}."
            )
        return ref

    def describe(self, ref: ArrayRef) -> str:
        """How messages name the logical array ``ref``: its path in a store of format 3.0 or
        older; in a stack its name and place (``params/w/exp_avg (stacks/3[4])``)."""
        if ref.stack is None:
            return ref.path
        name = self._stack_names().get((ref.path, ref.stack.index))
        place = describe_ref(ref)
        return place if name is None else f"{name} ({place})"

    def describe_stored(self, stored: StoredArray, start: int, stop: int) -> str:
        """How messages name flat elements ``[start, stop)`` of the stored array ``stored``:
        its path in a store of format 3.0 or older; in a stack the logical arrays they lie in
        (``params/w/exp_avg (stacks/3[4])``, or ``stacks/3[4:6] (params/w/fp32, ...)``)."""
        if stored.separator != STACK_SEPARATOR or not stored.shape or start >= stop:
            return stored.path
        each = max(1, math.prod(stored.shape[1:]))
        first, last = start // each, (stop - 1) // each
        known = self._stack_names()
        names = [known.get((stored.path, i), "?") for i in range(first, last + 1)]
        if first == last:
            return f"{names[0]} ({stored.path}[{first}])"
        more = ", ..." if len(names) > 2 else ""
        return f"{stored.path}[{first}:{last + 1}] ({', '.join(names[:2])}{more})"

    def _stack_names(self) -> dict[tuple[str, int], str]:
        """The name of every stacked logical array by its place ``(stack path, index)``."""
        with self._lock:
            if self._names is None:
                self._names = {
                    (item.path, item.stack.index): name
                    for name, item in self.manifest.arrays()
                    if item.stack is not None
                }
            return self._names

    def _array(self, stored: StoredArray) -> Array:
        """The zarr array ``stored``, built from the manifest: no ``zarr.json`` is fetched.

        The manifest is digest-checked and fully describes each array (docs/format.md §3.1),
        so readers need one request for all metadata; ``ucformat verify`` checks that every
        ``zarr.json`` agrees with it.
        """
        with self._lock:
            array = self._arrays.get(stored.path)
            if array is None:
                array = self._arrays[stored.path] = array_from_manifest(self.store, stored)
            return array

    # --- reads --------------------------------------------------------------------------------
    def read(self, name: str, state: str) -> Any:
        """The full value of ``state`` of ``name`` in the parameter's shape.

        ``"fp32"`` is the fp32 master weight (frozen parameters: their ``"value"``, in their own
        dtype, upcast to fp32);
        optimizer states keep the optimizer's key names; scalar states such as ``"step"``
        come back with their original type; buffers are read with state ``"buffer"``.
        """
        if state != BUFFER_STATE:
            entry = self.manifest.params.get(self.manifest.resolve(name))
            if entry is not None and state in entry.scalars:
                return scalar_value(entry.scalars[state])
        ref = self.array_ref(name, state)
        numel = int(np.prod(ref.shape, dtype=np.int64))
        flat = self.read_range(name, state, 0, numel) if numel else self._empty(ref, state)
        return flat.reshape(ref.shape)

    def read_array(self, ref: ArrayRef) -> torch.Tensor:
        """The whole array ``ref`` in its shape and stored dtype (e.g. an optimizer group's
        ``partition_states``, format 3.1)."""
        numel = math.prod(ref.shape)
        out = prefaulted_empty(numel, numpy_storage_dtype(ref.dtype))
        self.read_range_into(ref, 0, numel, out)
        return storage_to_torch(out, ref.dtype).reshape(ref.shape)

    def _empty(self, ref: ArrayRef, state: str) -> torch.Tensor:
        dtype = torch.float32 if state == FP32_STATE else torch_dtype(ref.dtype)
        return torch.empty(0, dtype=dtype)

    def read_range(
        self, name: str, state: str, start: int, stop: int, *, pin: bool = False
    ) -> torch.Tensor:
        """Flat elements ``[start, stop)`` of ``state`` of ``name`` as a 1-D tensor (``pin``:
        in page-locked host memory, for a copy to a CUDA device).

        Raises:
            OutOfRangeError: not ``0 <= start <= stop <= numel``.
        """
        ref = self.array_ref(name, state)
        numel = math.prod(ref.shape)
        if not 0 <= start <= stop <= numel:
            raise OutOfRangeError(
                f"{name} {state}: elements [{start}, {stop}) are outside the array's "
                f"[0, {numel}); give 0 <= start <= stop <= {numel}."
            )
        out = host_buffer(stop - start, ref.dtype, pin=pin)
        self.read_range_into(ref, start, stop, out)
        tensor = storage_to_torch(out, ref.dtype)
        if state == FP32_STATE and tensor.dtype != torch.float32:
            tensor = tensor.to(torch.float32)
        return tensor

    def read_runs(
        self, name: str, state: str, runs: Sequence[Run], *, pin: bool = False
    ) -> torch.Tensor:
        """The global flat ``runs`` of ``state`` of ``name``, concatenated (1-D).

        ``Run.chunk_start`` is each run's position in the result (as
        :func:`ucformat.layout.placements.local_runs` gives them for a local shard). Runs whose
        chunks touch are read as one range, so each chunk is fetched once. ``pin``: the result
        is page-locked host memory (bound for a CUDA device: one DMA, no other host copy).
        """
        ref = self.array_ref(name, state)
        total = sum(run.length for run in runs)
        out = host_buffer(total, ref.dtype, pin=pin)
        self.fill(ref, [(r.start, r.start + r.length, r.chunk_start) for r in runs], out)
        tensor = storage_to_torch(out, ref.dtype)
        if state == FP32_STATE and tensor.dtype != torch.float32:
            tensor = tensor.to(torch.float32)
        return tensor

    def fill(self, ref: ArrayRef, runs: Sequence[FlatRun], out: np.ndarray) -> None:
        """Fill ``out`` (1-D, storage dtype) with the flat runs ``(start, stop, at)`` of the
        logical array ``ref`` (elements ``[start, stop)`` to ``out[at:]``), every chunk
        fetched once (:meth:`fill_stored` on the stored array holding it)."""
        stored, offset = placement(ref)
        moved = [(offset + start, offset + stop, at) for start, stop, at in runs]
        self.fill_stored(stored, moved, out, self.describe(ref))

    def fill_stored(
        self, stored: StoredArray, runs: Sequence[FlatRun], out: np.ndarray, what: str = ""
    ) -> None:
        """Fill ``out`` (1-D, storage dtype) with the flat runs ``(start, stop, at)`` of the
        stored array ``stored`` (a stack's runs may span several of its logical arrays; ``what``
        names it in messages, default its path), every chunk fetched once: box chunks in one
        read of all runs; flat chunks per range of runs whose chunk-widened spans touch (read
        straight into place when a range is one run)."""
        runs = [run for run in runs if run[0] < run[1]]
        if not runs:
            return
        what = what or self.describe_stored(
            stored, min(run[0] for run in runs), max(run[1] for run in runs)
        )
        if stored.shape and not is_flat_chunking(stored.shape, stored.chunk_shape):
            self._read_runs(stored, runs, out, what)
            return
        spans = [chunk_aligned_range(stored.shape, stored.chunk_shape, a, b) for a, b, _ in runs]
        for _, _, members in merge_runs(spans):
            low = min(runs[i][0] for i in members)
            high = max(runs[i][1] for i in members)
            if len(members) == 1:
                start, stop, at = runs[members[0]]
                self._read_range(stored, start, stop, out[at : at + stop - start], what)
                continue
            staged = prefaulted_empty(high - low, numpy_storage_dtype(stored.dtype))
            self._read_range(stored, low, high, staged, what)
            for i in members:
                start, stop, at = runs[i]
                out[at : at + stop - start] = staged[start - low : stop - low]

    def check_range(self, ref: ArrayRef, start: int, stop: int) -> bool:
        """Whether flat elements ``[start, stop)`` of ``ref`` can be read in place, every chunk
        holding them checked (crc32c, in place: no bytes copied).

        False means "read through a staging buffer instead" (compressed or remote stores,
        layouts the direct path does not handle), never damage: damage raises.

        Raises:
            ChunkMissingError: a shard object holding part of the range is missing.
            CorruptDataError: a chunk or shard index of the range does not check out; the
                message names the array and the chunk (or shard object).
        """
        if start >= stop:
            return True
        stored, offset = placement(ref)
        result = check_runs(self.store, stored, stored.shard_key, [(offset + start, offset + stop)])
        if result.corrupt:
            raise result.error(self.describe(ref))
        return result.ok

    def read_range_into(self, ref: ArrayRef, start: int, stop: int, out: np.ndarray) -> None:
        """Fill ``out`` (storage dtype, length ``stop - start``) with flat elements of ``ref``."""
        if start >= stop:
            return
        stored, offset = placement(ref)
        self._read_range(stored, offset + start, offset + stop, out, self.describe(ref))

    def read_runs_into(self, ref: ArrayRef, runs: Sequence[FlatRun], out: np.ndarray) -> None:
        """Fill ``out`` (1-D, storage dtype) with flat runs ``(start, stop, at)`` of ``ref``:
        elements ``[start, stop)`` go to ``out[at:]``. All runs are one read: every chunk
        holding them is fetched once."""
        stored, offset = placement(ref)
        moved = [(offset + start, offset + stop, at) for start, stop, at in runs]
        self._read_runs(stored, moved, out, self.describe(ref))

    def _read_range(
        self, ref: StoredArray, start: int, stop: int, out: np.ndarray, what: str
    ) -> None:
        """Fill ``out`` with flat elements ``[start, stop)`` of the stored array ``ref``
        (``what`` names the logical array in messages)."""
        if start >= stop:
            return
        if ref.shape and not is_flat_chunking(ref.shape, ref.chunk_shape):
            self._read_runs(ref, [(start, stop, 0)], out.reshape(-1), what)
            return
        direct = NOT_APPLICABLE
        if out.ndim == 1 and out.flags.c_contiguous:
            direct = read_runs(self.store, ref, ref.shard_key, [(start, stop, 0)], out)
        if direct.ok:
            return  # uncompressed shards, every checksum good
        # zarr reads the range; where the direct read found damage, zarr's decoder names the
        # bad chunk, and where zarr would return values anyway the direct finding is raised
        array = self._array(ref)
        low, high = chunk_aligned_range(ref.shape, ref.chunk_shape, start, stop)
        boxes = flat_range_to_boxes(ref.shape, low, high)
        if len(boxes) == 1:
            values = read_box(array, boxes[0], what).reshape(-1)
        else:
            values = np.concatenate([read_box(array, box, what).reshape(-1) for box in boxes])
        if direct.corrupt:
            raise direct.error(what)
        out[:] = values[start - low : stop - low]

    def _read_runs(
        self, ref: StoredArray, runs: Sequence[FlatRun], out: np.ndarray, what: str
    ) -> None:
        """Fill ``out`` with the flat ``runs`` of the stored array ``ref``, as
        :meth:`read_runs_into` does for a logical array."""
        runs = [run for run in runs if run[0] < run[1]]
        if not runs:
            return
        direct = NOT_APPLICABLE
        if out.ndim == 1 and out.flags.c_contiguous:
            direct = read_runs(self.store, ref, ref.shard_key, runs, out)
        if direct.ok:
            return
        if ref.shape and is_flat_chunking(ref.shape, ref.chunk_shape):
            for start, stop, at in runs:
                self._read_range(ref, start, stop, out[at : at + stop - start], what)
            return
        # through zarr: the disjoint chunk-aligned boxes that hold the runs, each read once
        array = self._array(ref)
        covers = [
            (box, read_box(array, box, what))
            for box in chunk_cover(ref.shape, ref.chunk_shape, [(a, b) for a, b, _ in runs])
        ]
        if direct.corrupt:
            raise direct.error(what)
        for start, stop, at in runs:
            for box in flat_range_to_boxes(ref.shape, start, stop):
                sizes = [p.stop - p.start for p in box]
                size = math.prod(sizes)
                view = out[at : at + size].reshape(sizes)
                at += size
                for cover, values in covers:
                    part = intersect_boxes(box, cover)
                    if part is None:
                        continue
                    into = tuple(
                        slice(p.start - b.start, p.stop - b.start)
                        for p, b in zip(part, box, strict=True)
                    )
                    fro = tuple(
                        slice(p.start - c.start, p.stop - c.start)
                        for p, c in zip(part, cover, strict=True)
                    )
                    view[into] = values[fro]
