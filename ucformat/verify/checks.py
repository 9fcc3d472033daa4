"""Pure checks behind :func:`ucformat.verify`: manifest self-consistency and document diffs.

Nothing here reads a store; each function takes parsed data and returns the problems it finds
as ``(path, message)`` pairs, in a stable order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from ucformat.format.dtypes import itemsize
from ucformat.format.models import ArrayRef, CheckpointManifest
from ucformat.format.spec import buffer_array_path, stack_number, state_array_path
from ucformat.format.stacks import describe_ref
from ucformat.layout.grid import is_flat_block

__all__ = [
    "Difference",
    "ManifestArray",
    "bit_differences",
    "document_differences",
    "manifest_arrays",
    "manifest_differences",
    "ref_problems",
]

#: Manifest fields that record how and where the store was written, not what it holds: a store
#: saved live by the training job (``written_by`` ``save``: no files, no file format) holds the
#: same state as the checkpoint files the job wrote at the same step.
PROVENANCE_FIELDS = (
    "created_by",
    "digest",
    "source.path",
    "source.written_by",
    "source.checkpoint_format",
    "source.files",
)
#: Source fields some checkpoint formats do not record, and the value the converter then gives
#: them (DCP: no torch version, no device mesh): compared only when the source records them.
UNRECORDED: dict[str, object] = {
    "source.framework_version": "unknown",
    "source.mesh_shape": None,
    "source.mesh_dim_names": None,
}


@dataclass(frozen=True)
class ManifestArray:
    """One array the manifest references, with what it holds and the path the spec gives it."""

    what: str
    expected_path: str
    shape: tuple[int, ...]
    ref: ArrayRef


def manifest_arrays(manifest: CheckpointManifest) -> list[ManifestArray]:
    """Every array of ``manifest``: parameter states in manifest order (elementwise, then
    whole), optimizer groups' partition states, then buffers."""
    arrays = [
        ManifestArray(
            f"param '{name}' state '{state}'",
            state_array_path(name, state),
            tuple(entry.shape),
            ref,
        )
        for name, entry in manifest.params.items()
        for state, ref in entry.states.items()
    ]
    arrays += [  # format 3.1: states kept whole, in their own shape
        ManifestArray(
            f"param '{name}' whole state '{state}'",
            state_array_path(name, state),
            tuple(ref.shape),
            ref,
        )
        for name, entry in manifest.params.items()
        for state, ref in entry.whole_states.items()
    ]
    groups = manifest.optimizer.groups if manifest.optimizer is not None else []
    arrays += [  # format 3.1: states kept once per partition, one row per partition
        ManifestArray(
            f"optimizer group {index} partition state '{key}'",
            state_array_path(group.params[0], key),
            (state.partitions, *state.shape),
            state.array,
        )
        for index, group in enumerate(groups)
        for key, state in group.partition_states.items()
    ]
    arrays += [
        ManifestArray(f"buffer '{name}'", buffer_array_path(name), tuple(entry.shape), entry.array)
        for name, entry in manifest.buffers.items()
    ]
    return arrays


def ref_problems(array: ManifestArray, seen: set[str]) -> list[str]:
    """What is inconsistent about one :class:`ArrayRef` (``seen``: the arrays met so far, by
    path or, stacked, ``path[index]``; updated)."""
    ref, problems = array.ref, []
    if ref.stack is not None:
        if stack_number(ref.path) is None:
            problems.append(f"{array.what} points to '{ref.path}', which is no stack path")
    elif ref.path != array.expected_path:
        problems.append(f"{array.what} points to '{ref.path}', expected '{array.expected_path}'")
    where = describe_ref(ref)
    if where in seen:
        problems.append(f"{array.what}: '{where}' is used by two arrays")
    seen.add(where)
    if tuple(ref.shape) != array.shape:
        problems.append(f"{array.what}: array shape {ref.shape} differs from {list(array.shape)}")
    numel = prod(ref.shape)
    if ref.nbytes != numel * itemsize(ref.dtype):
        problems.append(
            f"{array.what}: nbytes is {ref.nbytes}, expected {numel * itemsize(ref.dtype)} "
            f"({numel} x {ref.dtype})"
        )
    if numel == 0:
        return problems
    chunk, shard = tuple(ref.chunk_shape), tuple(ref.shard_shape)
    if len(chunk) != len(ref.shape) or any(size < 1 for size in chunk):
        problems.append(
            f"{array.what}: chunk shape {ref.chunk_shape} is not a block of the array's "
            f"{len(ref.shape)} dimensions"
        )
    elif not is_flat_block(ref.shape, shard, overhang=True) or any(
        s % c for s, c in zip(shard, chunk, strict=True)
    ):
        problems.append(
            f"{array.what}: shard shape {ref.shard_shape} is not a flat-contiguous block of whole "
            f"chunks {ref.chunk_shape}"
        )
    return problems


@dataclass(frozen=True)
class Difference:
    """One field where two JSON documents disagree."""

    field: str
    found: Any
    expected: Any

    def describe(self, found_name: str, expected_name: str) -> str:
        """``'shape' is [16, 9] in the store, [16, 8] in the manifest``."""
        return (
            f"'{self.field}' is {_short(self.found)} in {found_name}, "
            f"{_short(self.expected)} in {expected_name}"
        )


_MISSING = "<absent>"


def document_differences(
    found: Any,
    expected: Any,
    prefix: str = "",
    ignore: tuple[str, ...] = (),
    *,
    unknown_ok: bool = False,
) -> Iterator[Difference]:
    """Walk two JSON documents and yield the leaf fields where they differ.

    Objects are compared key by key (a key present on one side only is a difference, unless
    ``unknown_ok`` and it is only in ``found``: a member of a newer minor version, §5), lists
    and scalars as a whole, by their JSON text. ``ignore`` lists dotted field names to skip.
    """
    if prefix in ignore:
        return
    if isinstance(found, dict) and isinstance(expected, dict):
        keys = set(expected) if unknown_ok else set(found) | set(expected)
        for key in sorted(keys, key=str):
            yield from document_differences(
                found.get(key, _MISSING),
                expected.get(key, _MISSING),
                f"{prefix}.{key}" if prefix else str(key),
                ignore,
                unknown_ok=unknown_ok,
            )
        return
    if _canonical(found) != _canonical(expected):
        yield Difference(prefix or "<document>", found, expected)


def _canonical(value: Any) -> str:
    """JSON text that tells ``1``, ``1.0`` and ``true`` apart, as the documents do."""
    return json.dumps(value, sort_keys=True, allow_nan=True)


def manifest_differences(stored: CheckpointManifest, planned: CheckpointManifest) -> list[str]:
    """Fields of the stored manifest that differ from the one re-planned from the source.

    Chunk and shard shapes are taken from the store when re-planning, so they agree unless the
    array sets differ; provenance fields (:data:`PROVENANCE_FIELDS`) are not compared, nor
    fields the source does not record (:data:`UNRECORDED`).
    """
    return [
        difference.describe("the store", "the source")
        for difference in document_differences(
            stored.model_dump(mode="json"),
            planned.model_dump(mode="json"),
            ignore=PROVENANCE_FIELDS,
        )
        if not (
            difference.field in UNRECORDED and difference.expected == UNRECORDED[difference.field]
        )
    ]


def bit_differences(stored: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Flat indices where two arrays of the same dtype and size differ bit for bit (NaN-safe)."""
    width = f"u{stored.dtype.itemsize}"
    return np.flatnonzero(
        np.ascontiguousarray(stored).reshape(-1).view(width)
        != np.ascontiguousarray(expected).reshape(-1).view(width)
    )


def _short(value: Any, limit: int = 120) -> str:
    text = "absent" if value is _MISSING else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
