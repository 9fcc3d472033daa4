"""Plan a conversion: which arrays to create and which bytes fill each shard. No I/O.

:func:`plan_convert` turns a :class:`~ucformat.sources.base.SourceCheckpoint` into a frozen
:class:`ConvertPlan`:

1. one :class:`~ucformat.format.models.ArrayRef` per (parameter, state) and per buffer, with chunk
   and shard shapes from :func:`~ucformat.layout.chunking.choose_chunking`, or, for a DeepSpeed
   ZeRO-3 source, with shards on the ranks' partition boundaries where those fall on whole rows
   (:func:`~ucformat.layout.chunking.fragment_rows`): each such shard has one holder, so a live
   save moves none of its bytes between ranks;
2. a proof that every array's source fragments tile it exactly (no hole, overlap or overflow);
3. one :class:`WriteUnit` per shard: the shard's region and the :class:`CopyItem` runs that fill
   it. Shards are flat-contiguous, so a unit is a flat range of the array, and each unit is
   written once by exactly one writer: units can be spread over threads, processes or hosts.
4. the manifest to commit once every unit is written.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from math import prod

from ucformat._version import __version__
from ucformat.errors import InvalidNameError
from ucformat.format.dtypes import itemsize
from ucformat.format.megatron import MegatronLayout
from ucformat.format.models import (
    ArrayRef,
    BufferEntry,
    CheckpointManifest,
    ParamEntry,
    PartitionState,
)
from ucformat.format.spec import (
    BOX_CHUNKS_VERSION,
    FLAT_CHUNKS_VERSION,
    FORMAT_VERSION,
    FP32_STATE,
    VALUE_STATE,
    buffer_array_path,
    name_problem,
    state_array_path,
)
from ucformat.format.tensor_parallel import TensorParallelInfo
from ucformat.layout.chunking import (
    Chunking,
    ChunkPolicy,
    aligned_chunking,
    choose_chunking,
    fragment_rows,
    is_flat_chunking,
)
from ucformat.layout.ranges import check_tiling
from ucformat.sources.base import ArraySource, SourceCheckpoint, SourceFragment

__all__ = [
    "ConvertOptions",
    "ConvertPlan",
    "CopyItem",
    "WriteUnit",
    "layout_version",
    "plan_convert",
]


def layout_version(
    arrays: list[ArrayRef],
    tensor_parallel: TensorParallelInfo | None = None,
    megatron: MegatronLayout | None = None,
    non_elementwise: bool = False,
) -> str:
    """The lowest format version whose rules the store satisfies (docs/format.md §5.3, §5.4).

    Format 3.0 adds to 2.1 only box chunks and the ``tensor_parallel.framework`` value
    ``deepspeed-patterns``: a store with neither is written as 2.1, so readers of format 2
    still read it; either makes it 3.0, which they refuse instead of misreading. Format 3.1
    adds optional members (``manifest.megatron``'s layout of pipeline, expert and optimizer;
    optimizer states that are not elementwise, ``non_elementwise``): a store that has them is
    3.1.
    """
    if non_elementwise or (megatron is not None and megatron.has_minor_3_1_members()):
        return FORMAT_VERSION
    flat = all(
        prod(ref.shape) == 0 or is_flat_chunking(ref.shape, ref.chunk_shape) for ref in arrays
    )
    known = tensor_parallel is None or tensor_parallel.framework == "deepspeed-autotp"
    return FLAT_CHUNKS_VERSION if flat and known else BOX_CHUNKS_VERSION


@dataclass(frozen=True)
class ConvertOptions:
    """How to lay the store out."""

    policy: ChunkPolicy = field(default_factory=ChunkPolicy)
    compressor: str = "none"
    #: Chunk and shard shapes for these array paths, instead of the policy's choice (``verify``
    #: re-plans a source in the layout of an existing store).
    layouts: Mapping[str, Chunking] = field(default_factory=dict)
    #: The format version of the manifest; None: the lowest that describes the layout
    #: (:func:`layout_version`). ``verify`` asks for the store's own: to re-plan a source as
    #: that writer laid it out (format 1: frozen values under ``fp32``).
    format_version: str | None = None


@dataclass(frozen=True)
class CopyItem:
    """Copy ``length`` elements from ``fragment.tensor[tensor_start:]`` to ``buffer[offset:]``."""

    fragment: SourceFragment
    tensor_start: int
    offset: int
    length: int


@dataclass(frozen=True)
class WriteUnit:
    """One shard of one array: its region, its flat range and the copies that fill it."""

    array: int
    region: tuple[slice, ...]
    flat_start: int
    flat_stop: int
    copies: tuple[CopyItem, ...]

    @property
    def numel(self) -> int:
        """Elements in the region."""
        return self.flat_stop - self.flat_start


@dataclass(frozen=True)
class ConvertPlan:
    """Everything needed to write a store, decided up front."""

    arrays: tuple[ArrayRef, ...]
    units: tuple[WriteUnit, ...]
    manifest: CheckpointManifest

    @property
    def nbytes(self) -> int:
        """Uncompressed bytes the plan writes."""
        return sum(ref.nbytes for ref in self.arrays)


def plan_convert(source: SourceCheckpoint, options: ConvertOptions) -> ConvertPlan:
    """Plan the conversion of ``source``; raises CoverageError if any array would have a hole."""
    arrays: list[ArrayRef] = []
    sources: list[ArraySource] = []
    partitioned = source.source.framework == "deepspeed" and source.source.zero_stage == 3

    def add(path: str, array: ArraySource, what: str) -> ArrayRef:
        check_tiling(what, array.numel, ((f.start, f.start + f.length) for f in array.fragments))
        chunking = options.layouts.get(path)
        if chunking is None or len(chunking.chunk_shape) != len(array.shape):
            chunking = _chunking(array, options.policy, partitioned)
        ref = ArrayRef(
            path=path,
            dtype=array.dtype,  # type: ignore[arg-type]
            shape=list(array.shape),
            chunk_shape=list(chunking.chunk_shape),
            shard_shape=list(chunking.shard_shape),
            nbytes=array.numel * itemsize(array.dtype),
            compressor=options.compressor,  # type: ignore[arg-type]
        )
        arrays.append(ref)
        sources.append(array)
        return ref

    legacy = (options.format_version or "").partition(".")[0] == "1"
    aliases: dict[str, list[str]] = {}
    for alias, owner in source.tied.items():
        _check_name(alias, "tied alias", f" of parameter '{owner}'")
        aliases.setdefault(owner, []).append(alias)
    params: dict[str, ParamEntry] = {}
    for name, param in source.params.items():
        _check_name(name, "parameter")
        for state in param.arrays:
            _check_name(state, "state", f" of parameter '{name}'")
        states = {
            state: add(state_array_path(name, state), array, f"param '{name}' state '{state}'")
            for state, array in _format_states(param.arrays, legacy).items()
        }
        whole = {
            key: add(state_array_path(name, key), array, f"param '{name}' whole state '{key}'")
            for key, array in param.whole.items()
        }
        params[name] = ParamEntry(
            shape=list(param.shape),
            dtype=param.dtype,  # type: ignore[arg-type]
            requires_grad=param.requires_grad,
            group=param.group,
            states=states,
            scalars=param.scalars,
            aliases=aliases.get(name, []),
            whole_states=whole,
        )
    for name in source.buffers:
        _check_name(name, "buffer")
    buffers = {
        name: BufferEntry(
            shape=list(array.shape),
            dtype=array.dtype,  # type: ignore[arg-type]
            array=add(buffer_array_path(name), array, f"buffer '{name}'"),
        )
        for name, array in source.buffers.items()
    }
    tied = {alias: owner for alias, owner in source.tied.items() if owner in params}
    optimizer = source.optimizer
    if optimizer is not None and source.partition_states:  # under each group's first member
        groups = list(optimizer.groups)
        for g, held in sorted(source.partition_states.items()):
            first = groups[g].params[0]
            refs = {
                key: PartitionState(
                    partitions=part.array.shape[0],
                    shape=list(part.array.shape[1:]),
                    replicated=part.replicated,
                    array=add(state_array_path(first, key), part.array, f"group {g} '{key}'"),
                )
                for key, part in held.items()
            }
            groups[g] = groups[g].model_copy(update={"partition_states": refs})
        optimizer = optimizer.model_copy(update={"groups": groups})
    odd = bool(source.partition_states) or any(p.whole for p in source.params.values())
    manifest = CheckpointManifest(
        format_version=options.format_version
        or layout_version(arrays, source.tensor_parallel, source.megatron, odd),
        created_by=f"ucformat {__version__}",
        source=source.source,
        params=params,
        tied=tied,
        buffers=buffers,
        optimizer=optimizer,
        progress=source.progress,
        client_state=source.client_state,
        megatron=source.megatron,
        tensor_parallel=source.tensor_parallel,
        experts=source.experts,
    )
    units = tuple(
        unit
        for index, (ref, array) in enumerate(zip(arrays, sources, strict=True))
        for unit in _units(index, ref, array)
    )
    return ConvertPlan(tuple(arrays), units, manifest)


def _chunking(array: ArraySource, policy: ChunkPolicy, partitioned: bool) -> Chunking:
    """The policy's chunking; for ZeRO-3 partitions (``partitioned``), shards on their row
    boundaries where :func:`~ucformat.layout.chunking.fragment_rows` finds them."""
    size = itemsize(array.dtype)
    rows = (
        fragment_rows(array.shape, size, policy, [f.start for f in array.fragments])
        if partitioned
        else None
    )
    if rows is None:
        return choose_chunking(array.shape, size, policy)
    return aligned_chunking(array.shape, size, policy, rows)


def _format_states(arrays: Mapping[str, ArraySource], legacy: bool) -> Mapping[str, ArraySource]:
    """Format 1 stored a frozen parameter's value under ``fp32``; format 2 under ``value``."""
    if legacy and VALUE_STATE in arrays:
        return {FP32_STATE if k == VALUE_STATE else k: v for k, v in arrays.items()}
    return arrays


def _check_name(name: str, kind: str, owner: str = "") -> None:
    problem = name_problem(name, "parameter" if kind == "tied alias" else kind)
    if problem is not None:
        raise InvalidNameError(
            f"{kind} name {name!r}{owner} cannot name an array of a ucformat store: {problem} "
            "(docs/format.md §2.4). Rename it in the model or optimizer."
        )


def shard_regions(shape: list[int], shard_shape: list[int]) -> Iterator[tuple[slice, ...]]:
    """Every shard's region (clipped to the array), in row-major shard order."""
    if not shape:
        yield ()
        return
    if prod(shape) == 0:
        return
    ranges = [range(0, dim, step) for dim, step in zip(shape, shard_shape, strict=True)]
    for corner in itertools.product(*ranges):
        yield tuple(
            slice(start, min(start + step, dim))
            for start, step, dim in zip(corner, shard_shape, shape, strict=True)
        )


def _flat_start(shape: list[int], region: tuple[slice, ...]) -> int:
    offset = 0
    for dim, piece in zip(shape, region, strict=True):
        offset = offset * dim + piece.start
    return offset


def _units(index: int, ref: ArrayRef, array: ArraySource) -> Iterator[WriteUnit]:
    fragments = sorted(array.fragments, key=lambda f: f.start)
    starts = [f.start for f in fragments]
    for region in shard_regions(ref.shape, ref.shard_shape):
        start = _flat_start(ref.shape, region)
        stop = start + prod(s.stop - s.start for s in region)
        first = max(0, bisect.bisect_right(starts, start) - 1)
        copies: list[CopyItem] = []
        for fragment in fragments[first:]:
            if fragment.start >= stop:
                break
            lo, hi = max(start, fragment.start), min(stop, fragment.start + fragment.length)
            if lo < hi:
                copies.append(
                    CopyItem(
                        fragment, fragment.tensor_start + lo - fragment.start, lo - start, hi - lo
                    )
                )
        yield WriteUnit(index, region, start, stop, tuple(copies))
