"""What a manifest may say before anything reads or writes by it (docs/format.md §2.4, §3.8).

Pure checks used by the validators of :mod:`ucformat.format.models`: every name and path that
comes from a manifest is one the key rule admits (so no reader, verifier or export ever reaches
outside the store or the export folder), and every array's shape, chunk and shard are sane
(no zero chunk, no array larger than :data:`MAX_ARRAY_ELEMENTS`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ucformat.format.spec import (
    MAX_NAME_BYTES,
    buffer_array_path,
    name_problem,
    stack_number,
    state_array_path,
)

if TYPE_CHECKING:
    from ucformat.format.models import ArrayRef

__all__ = [
    "MAX_ARRAY_DIMS",
    "MAX_ARRAY_ELEMENTS",
    "array_shape_problem",
    "component_problem",
    "entry_name_problems",
    "relative_path_problem",
    "shape_problem",
    "stack_problem",
]

#: The most elements one array may declare (2**47, about 1.4e14: 563 TB of float32).
MAX_ARRAY_ELEMENTS = 2**47
#: The most dimensions one array may declare.
MAX_ARRAY_DIMS = 32
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def shape_problem(shape: list[int]) -> str | None:
    """Why ``shape`` is not an array shape this reader accepts, or None."""
    if len(shape) > MAX_ARRAY_DIMS:
        return f"it has {len(shape)} dimensions, more than {MAX_ARRAY_DIMS}"
    if any(n < 0 for n in shape):
        return f"shape {shape} has a negative extent"
    if math.prod(shape) > MAX_ARRAY_ELEMENTS:
        return f"shape {shape} has more than {MAX_ARRAY_ELEMENTS} elements"
    return None


def array_shape_problem(
    shape: list[int], chunk_shape: list[int], shard_shape: list[int]
) -> str | None:
    """Why an array's shape, chunk shape and shard shape do not fit together, or None."""
    problem = shape_problem(shape)
    if problem is not None:
        return problem
    if not len(shape) == len(chunk_shape) == len(shard_shape):
        return (
            f"shape {shape}, chunk shape {chunk_shape} and shard shape {shard_shape} have "
            "different lengths"
        )
    if any(n < 1 for n in [*chunk_shape, *shard_shape]):
        return f"chunk shape {chunk_shape} and shard shape {shard_shape} must be at least 1"
    dims = [max(n, 1) for n in shape]
    if any(c > n for c, n in zip(chunk_shape, dims, strict=True)):
        return f"chunk shape {chunk_shape} exceeds shape {shape}"
    if any(s > -(-n // c) * c for s, c, n in zip(shard_shape, chunk_shape, dims, strict=True)):
        return f"shard shape {shard_shape} reaches past shape {shape} by more than a chunk"
    return None


def component_problem(text: str) -> str | None:
    """Why ``text`` may not be one file or folder name (a tag), or None."""
    if not text or text in (".", ".."):
        return f"{text!r} is not a file name"
    if "/" in text or "\\" in text or _CONTROL.search(text):
        return f"{text!r} holds '/', '\\' or a control character"
    if len(text.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"{text!r} is longer than {MAX_NAME_BYTES} bytes"
    return None


def relative_path_problem(text: str) -> str | None:
    """Why ``text`` may not be a relative path inside a folder (``a/b.pt``), or None."""
    if text.startswith("/"):
        return f"{text!r} is an absolute path"
    for part in text.split("/"):
        problem = component_problem(part)
        if problem is not None:
            return problem
    return None


def _path_problem(path: str, own: str, stacked: bool, what: str) -> str | None:
    """Why ``path`` may not hold ``what``: a stacked array's path is ``stacks/<n>``, any other
    one's its ``own`` path (§2.5, §3.8)."""
    if stacked:
        if stack_number(path) is None:
            return f"{what} points to {path!r}, which is no stack path ('stacks/<n>')"
        return None
    if path != own:
        return f"{what} points to {path!r}, not its own array"
    return None


def entry_name_problems(
    params: Iterable[tuple[str, Iterable[tuple[str, str, bool]], Iterable[str]]],
    buffers: Iterable[tuple[str, str, bool]],
    tied: Iterable[tuple[str, str]],
) -> str | None:
    """The first name or array path of a manifest that §2.4 refuses, said in words, or None.

    Args:
        params: (fqn, [(state, array path, stacked)], aliases) of every parameter.
        buffers: (fqn, array path, stacked) of every buffer.
        tied: (alias, owner) pairs.
    """
    for fqn, states, aliases in params:
        problem = name_problem(fqn, "parameter")
        if problem is not None:
            return f"parameter name {fqn!r}: {problem}"
        for state, path, stacked in states:
            problem = name_problem(state, "state")
            if problem is not None:
                return f"state {state!r} of {fqn!r}: {problem}"
            problem = _path_problem(
                path, state_array_path(fqn, state), stacked, f"{fqn!r} state {state!r}"
            )
            if problem is not None:
                return problem
        for alias in aliases:
            problem = name_problem(alias, "parameter")
            if problem is not None:
                return f"alias {alias!r} of {fqn!r}: {problem}"
    for fqn, path, stacked in buffers:
        problem = name_problem(fqn, "buffer")
        if problem is not None:
            return f"buffer name {fqn!r}: {problem}"
        problem = _path_problem(path, buffer_array_path(fqn), stacked, f"buffer {fqn!r}")
        if problem is not None:
            return problem
    for alias, owner in tied:
        problem = name_problem(alias, "parameter")
        if problem is not None:
            return f"tied alias {alias!r} (of {owner!r}): {problem}"
    return None


def stack_problem(arrays: Iterable[tuple[str, ArrayRef]]) -> str | None:
    """Why the stacks of a manifest's logical arrays (``(name, ref)`` pairs) do not describe
    well-formed zarr arrays (§2.5), or None: the members of one stack MUST agree on its layout
    (dtype, shape, chunk and shard shapes, compressor, size, arrays per shard) and take every
    index of it exactly once."""
    layouts: dict[str, tuple[object, ...]] = {}
    sizes: dict[str, int] = {}
    taken: dict[str, dict[int, str]] = {}
    for name, ref in arrays:
        slot = ref.stack
        if slot is None:
            continue
        layout = (ref.dtype, ref.shape, ref.chunk_shape, ref.shard_shape, ref.compressor,
                  slot.size, slot.per_shard)  # fmt: skip
        first = layouts.setdefault(ref.path, layout)
        if first != layout:
            return (
                f"{name} in stack {ref.path!r} has layout {_layout_text(layout)}, but the "
                f"stack's other arrays have {_layout_text(first)}"
            )
        sizes[ref.path] = slot.size
        members = taken.setdefault(ref.path, {})
        other = members.setdefault(slot.index, name)
        if other != name:
            return f"{name} and {other} both claim index {slot.index} of stack {ref.path!r}"
    for path, members in taken.items():
        if len(members) != sizes[path]:
            return (
                f"stack {path!r} holds {sizes[path]} arrays but the manifest names "
                f"{len(members)} of them"
            )
    return None


def _layout_text(layout: tuple[object, ...]) -> str:
    dtype, shape, chunk, shard, compressor, size, per_shard = layout
    return (
        f"{dtype} {shape}, chunks {chunk}, shards {shard}, {compressor}, size {size}, "
        f"{per_shard} per shard"
    )
