"""Plan a conversion: which arrays to create and which bytes fill each shard. No I/O.

:func:`plan_convert` turns a :class:`~ucformat.sources.base.SourceCheckpoint` into a frozen
:class:`ConvertPlan`:

1. one logical array (:class:`~ucformat.format.models.ArrayRef`) per (parameter, state) and per
   buffer, with chunk and shard shapes from :func:`~ucformat.layout.chunking.choose_chunking`,
   or, for a DeepSpeed ZeRO-3 source, with shards on the ranks' partition boundaries where
   those fall on whole rows (:func:`~ucformat.layout.chunking.fragment_rows`): each such shard
   has one holder, so a live save moves none of its bytes between ranks;
2. a proof that every array's source fragments tile it exactly (no hole, overlap or overflow);
3. the stored arrays (:class:`~ucformat.format.stacks.StoredArray`): logical arrays of one
   layout stacked into one zarr array (format 3.1, :mod:`ucformat.layout.stacking`), or each
   its own (the layout of older versions, which ``verify`` re-plans stores of);
4. one :class:`WriteUnit` per shard of a stored array: the shard's region and the
   :class:`CopyItem` runs that fill it. Shards are flat-contiguous, so a unit is a flat range
   of its stored array, and each unit is written once by exactly one writer: units can be
   spread over threads, processes or hosts.
5. the manifest to commit once every unit is written.

Steps 1 to 3 depend only on the source's layout (:func:`layout_key`: names, shapes, dtypes,
fragments and their holders, options), and their outcome is the plan's :class:`PlanLayout`. A
live save keeps it and passes it back for its next save (``kept``): when the layout key is the
same, those steps are taken as they were, and only the units and the manifest are made for the
new source's fragments and values.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from math import prod

from ucformat._version import __version__
from ucformat.errors import InvalidNameError
from ucformat.format.dtypes import itemsize
from ucformat.format.models import (
    ArrayRef,
    BufferEntry,
    CheckpointManifest,
    ParamEntry,
    PartitionState,
    StackSlot,
)
from ucformat.format.spec import (
    FORMAT_VERSION,
    FP32_STATE,
    VALUE_STATE,
    buffer_array_path,
    is_stacked_version,
    name_problem,
    stack_array_path,
    state_array_path,
)
from ucformat.format.stacks import StoredArray, stored_array
from ucformat.layout.chunking import (
    Chunking,
    ChunkPolicy,
    aligned_chunking,
    choose_chunking,
    fragment_rows,
)
from ucformat.layout.ranges import check_tiling
from ucformat.layout.stacking import arrays_per_shard, group_stacks
from ucformat.sources.base import ArraySource, PartitionSource, SourceCheckpoint, SourceFragment

__all__ = [
    "ConvertOptions",
    "ConvertPlan",
    "CopyItem",
    "PlanLayout",
    "WriteUnit",
    "layout_key",
    "plan_convert",
]


@dataclass(frozen=True)
class ConvertOptions:
    """How to lay the store out."""

    policy: ChunkPolicy = field(default_factory=ChunkPolicy)
    compressor: str = "none"
    #: Chunk and shard shapes for these logical arrays (by the name ``params/<fqn>/<state>`` or
    #: ``buffers/<fqn>``), instead of the policy's choice (a live save's shards on its owners'
    #: rows; ``verify`` re-plans a source in the layout of an existing store).
    layouts: Mapping[str, Chunking] = field(default_factory=dict)
    #: The format version of the manifest; None: this writer's (:data:`FORMAT_VERSION`,
    #: stacks). ``verify`` asks for the store's own: to re-plan a source as that writer laid it
    #: out (format 3.0 and older: one array per (parameter, state); format 1: frozen values
    #: under ``fp32``).
    format_version: str | None = None
    #: Where each logical array lies (by name, as ``layouts``), instead of the stacking policy's
    #: choice: ``verify`` re-plans a source into the stacks of an existing store. Used only when
    #: it places every logical array of the source in a stack.
    placements: Mapping[str, ArrayRef] = field(default_factory=dict)


@dataclass(frozen=True)
class CopyItem:
    """Copy ``length`` elements from ``fragment.tensor[tensor_start:]`` to ``buffer[offset:]``."""

    fragment: SourceFragment
    tensor_start: int
    offset: int
    length: int


@dataclass(frozen=True)
class WriteUnit:
    """One shard of one stored array: its region, its flat range and the copies that fill it."""

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
class PlanLayout:
    """What a plan decided that depends only on the layout of its source: the stored arrays,
    every logical array's chunking and place (in plan order: parameters' states, then
    buffers), and the format version. A live save keeps it (:mod:`ucformat.write.live_save`)
    and plans its next save of the same layout from it (:func:`plan_convert` with ``kept``)
    instead of deciding again."""

    #: :func:`layout_key` of the source and options it was planned for.
    key: tuple[object, ...]
    #: A digest of ``key``, the same in every process that planned the same layout.
    digest: str
    arrays: tuple[StoredArray, ...]
    refs: tuple[ArrayRef, ...]
    version: str


@dataclass(frozen=True)
class ConvertPlan:
    """Everything needed to write a store, decided up front: the zarr arrays to create, the
    shards that fill them, and the manifest naming every logical array in them."""

    arrays: tuple[StoredArray, ...]
    units: tuple[WriteUnit, ...]
    manifest: CheckpointManifest
    #: The layout decisions (None only for plans built by hand).
    layout: PlanLayout | None = None

    @property
    def nbytes(self) -> int:
        """Uncompressed bytes the plan writes."""
        return sum(array.numel * itemsize(array.dtype) for array in self.arrays)


@dataclass(frozen=True)
class _Logical:
    """One logical array while planning: its name, its reference (path and stack slot still
    to be given) and its source."""

    name: str
    ref: ArrayRef
    source: ArraySource


def layout_key(source: SourceCheckpoint, options: ConvertOptions) -> tuple[object, ...]:
    """Everything of ``source`` and ``options`` a plan's layout depends on: names, shapes,
    dtypes, groups, ties, and every fragment's place and holder (a live tensor's rank), the
    options. Two sources with equal keys get the same stored arrays, the same units (copying
    from their own tensors) and the same writers; only the manifest's values may differ."""

    def arrays(array: ArraySource) -> tuple[object, ...]:
        return (array.shape, array.dtype, tuple(
            (f.start, f.length, f.tensor_start, getattr(f.tensor, "rank", None),
             f.tensor.dtype_name)
            for f in array.fragments
        ))  # fmt: skip

    params = tuple(
        (name, param.shape, param.dtype, param.requires_grad, param.group,
         tuple((state, arrays(array)) for state, array in param.arrays.items()),
         tuple((key, arrays(array)) for key, array in param.whole.items()))
        for name, param in source.params.items()
    )  # fmt: skip
    buffers = tuple((name, arrays(array)) for name, array in source.buffers.items())
    partitions = tuple(
        (g, tuple((key, part.replicated, arrays(part.array)) for key, part in held.items()))
        for g, held in sorted(source.partition_states.items())
    )
    layouts = tuple(sorted(options.layouts.items()))
    placements = tuple(sorted((k, v.model_dump_json()) for k, v in options.placements.items()))
    settings = (options.policy, options.compressor, options.format_version, layouts, placements)
    return (settings, params, buffers, partitions, tuple(sorted(source.tied.items())))


def plan_convert(
    source: SourceCheckpoint, options: ConvertOptions, kept: PlanLayout | None = None
) -> ConvertPlan:
    """Plan the conversion of ``source``; raises CoverageError if any array would have a hole.

    ``kept``: the layout of an earlier plan (``ConvertPlan.layout``); when ``source`` and
    ``options`` have its :func:`layout_key`, its decisions are taken as they are (no chunking,
    stacking or checks again) and only the units and the manifest are made anew.
    """
    key = layout_key(source, options)
    if kept is not None and kept.key == key:
        return _plan(source, kept, kept=True)
    logical: list[_Logical] = []
    partitioned = source.source.framework == "deepspeed" and source.source.zero_stage == 3

    def add(name: str, array: ArraySource, what: str) -> None:
        check_tiling(what, array.numel, ((f.start, f.start + f.length) for f in array.fragments))
        chunking = options.layouts.get(name)
        if chunking is None or len(chunking.chunk_shape) != len(array.shape):
            chunking = _chunking(array, options.policy, partitioned)
        ref = ArrayRef(
            path=name,
            dtype=array.dtype,  # type: ignore[arg-type]
            shape=list(array.shape),
            chunk_shape=list(chunking.chunk_shape),
            shard_shape=list(chunking.shard_shape),
            nbytes=array.numel * itemsize(array.dtype),
            compressor=options.compressor,  # type: ignore[arg-type]
        )
        logical.append(_Logical(name, ref, array))

    legacy = (options.format_version or "").partition(".")[0] == "1"
    for alias, owner in source.tied.items():
        _check_name(alias, "tied alias", f" of parameter '{owner}'")
    for name, param in source.params.items():
        _check_name(name, "parameter")
        for state in param.arrays:
            _check_name(state, "state", f" of parameter '{name}'")
        for state, array in _format_states(param.arrays, legacy).items():
            add(state_array_path(name, state), array, f"param '{name}' state '{state}'")
        for whole_key, array in param.whole.items():
            add(
                state_array_path(name, whole_key),
                array,
                f"param '{name}' whole state '{whole_key}'",
            )
    for name, array in source.buffers.items():
        _check_name(name, "buffer")
        add(buffer_array_path(name), array, f"buffer '{name}'")
    for g, part_key, part in _partition_states(source):  # under each group's first member
        first = source.optimizer.groups[g].params[0]  # type: ignore[union-attr]
        add(state_array_path(first, part_key), part.array, f"group {g} '{part_key}'")
    version = options.format_version
    if version is None or is_stacked_version(version):
        refs, stored = _stacked(logical, options)
        version = version or FORMAT_VERSION
    else:
        refs = [item.ref for item in logical]
        stored = [stored_array(ref) for ref in refs]
    digest = hashlib.sha256(repr(key).encode()).hexdigest()
    return _plan(source, PlanLayout(key, digest, tuple(stored), tuple(refs), version), legacy)


def _plan(
    source: SourceCheckpoint, layout: PlanLayout, legacy: bool = False, kept: bool = False
) -> ConvertPlan:
    """The units and the manifest of ``source`` in ``layout`` (decided for its layout key;
    ``kept``: by an earlier plan, whose manifest was validated)."""
    sources = [
        array
        for param in source.params.values()
        for array in (*_format_states(param.arrays, legacy).values(), *param.whole.values())
    ]
    sources += source.buffers.values()
    sources += [part.array for _, _, part in _partition_states(source)]
    fragments = _stored_fragments(layout, sources)
    units = tuple(
        unit
        for index, (array, pieces) in enumerate(zip(layout.arrays, fragments, strict=True))
        for unit in _units(index, array, pieces)
    )
    return ConvertPlan(layout.arrays, units, _manifest(source, layout, legacy, kept), layout)


def _stored_fragments(layout: PlanLayout, sources: list[ArraySource]) -> list[list[SourceFragment]]:
    """Each stored array's fragments at their flat positions in it (a stack's members in index
    order), from the logical arrays' ``sources`` (in ``layout.refs`` order)."""
    where = {array.path: index for index, array in enumerate(layout.arrays)}
    pieces: list[list[SourceFragment]] = [[] for _ in layout.arrays]
    order = sorted(
        range(len(sources)),
        key=lambda i: (where[layout.refs[i].path], _slot(layout.refs[i])),
    )
    for i in order:
        ref, array = layout.refs[i], sources[i]
        base = _slot(ref) * array.numel
        target = pieces[where[ref.path]]
        if base:
            target += [
                SourceFragment(f.tensor, f.tensor_start, f.start + base, f.length)
                for f in array.fragments
            ]
        else:
            target += array.fragments
    return pieces


def _slot(ref: ArrayRef) -> int:
    return 0 if ref.stack is None else ref.stack.index


def _manifest(
    source: SourceCheckpoint, layout: PlanLayout, legacy: bool, kept: bool
) -> CheckpointManifest:
    """The manifest of ``source`` whose logical arrays are ``layout.refs`` (in plan order).

    ``kept``: the layout's first manifest was validated, and ``source`` has the same names,
    shapes, groups and ties (its :func:`layout_key`); its new values (scalars, progress,
    optimizer and client state, provenance) are validated models already. The manifest is
    then assembled without validating it all again (``model_construct``).
    """
    refs = iter(layout.refs)
    aliases: dict[str, list[str]] = {}
    for alias, owner in source.tied.items():
        aliases.setdefault(owner, []).append(alias)
    entry = ParamEntry.model_construct if kept else ParamEntry
    buffer_entry = BufferEntry.model_construct if kept else BufferEntry
    params = {
        name: entry(
            shape=list(param.shape),
            dtype=param.dtype,  # type: ignore[arg-type]
            requires_grad=param.requires_grad,
            group=param.group,
            states={state: next(refs) for state in _format_states(param.arrays, legacy)},
            scalars=param.scalars,
            aliases=aliases.get(name, []),
            whole_states={key: next(refs) for key in param.whole},
        )
        for name, param in source.params.items()
    }
    buffers = {
        name: buffer_entry(
            shape=list(array.shape),
            dtype=array.dtype,  # type: ignore[arg-type]
            array=next(refs),
        )
        for name, array in source.buffers.items()
    }
    tied = {alias: owner for alias, owner in source.tied.items() if owner in params}
    optimizer = source.optimizer
    held = _partition_states(source)
    if optimizer is not None and held:
        groups = list(optimizer.groups)
        for g, key, part in held:
            state = PartitionState(
                partitions=part.array.shape[0],
                shape=list(part.array.shape[1:]),
                replicated=part.replicated,
                array=next(refs),
            )
            states = {**groups[g].partition_states, key: state}
            groups[g] = groups[g].model_copy(update={"partition_states": states})
        optimizer = optimizer.model_copy(update={"groups": groups})
    manifest = CheckpointManifest.model_construct if kept else CheckpointManifest
    return manifest(
        format_version=layout.version,
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
        digest=None,
    )


def _partition_states(source: SourceCheckpoint) -> list[tuple[int, str, PartitionSource]]:
    """``(group, key, state)`` of every optimizer state kept once per flat partition of a param
    group (format 3.1), in group order: named under the group's first member."""
    if source.optimizer is None:
        return []
    return [
        (g, key, part)
        for g, held in sorted(source.partition_states.items())
        for key, part in held.items()
    ]


def _stacked(
    logical: list[_Logical], options: ConvertOptions
) -> tuple[list[ArrayRef], list[StoredArray]]:
    """Format 3.1: the logical arrays' references in their stacks, and the stacks."""
    stacks = _given_stacks(logical, options.placements)
    if stacks is None:
        stacks = _policy_stacks(logical, options.policy.shard_bytes)
    refs: list[ArrayRef | None] = [None] * len(logical)
    stored: list[StoredArray] = []
    for number, (members, per_shard) in enumerate(stacks):
        for index, member in enumerate(members):
            slot = StackSlot(index=index, size=len(members), per_shard=per_shard)
            refs[member] = logical[member].ref.model_copy(
                update={"path": stack_array_path(number), "stack": slot}
            )
        first = refs[members[0]]
        assert first is not None
        stored.append(stored_array(first))
    return [ref for ref in refs if ref is not None], stored


def _layout_key(ref: ArrayRef) -> tuple[object, ...]:
    return (ref.dtype, tuple(ref.shape), tuple(ref.chunk_shape), tuple(ref.shard_shape),
            ref.compressor)  # fmt: skip


def _policy_stacks(logical: list[_Logical], shard_bytes: int) -> list[tuple[list[int], int]]:
    """The stacks :mod:`ucformat.layout.stacking` gives: members and arrays per shard."""
    keys = [_layout_key(item.ref) for item in logical]
    counts: dict[tuple[object, ...], int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1

    def fit(item: _Logical, count: int) -> int:
        ref = item.ref
        return arrays_per_shard(
            count, ref.shape, ref.chunk_shape, ref.shard_shape, itemsize(ref.dtype), shard_bytes
        )

    per_shard = [fit(item, counts[key]) for item, key in zip(logical, keys, strict=True)]
    objects = [
        1 if per > 1 else _shard_count(item.ref)
        for item, per in zip(logical, per_shard, strict=True)
    ]
    return [
        (members, fit(logical[members[0]], len(members)))
        for members in group_stacks(keys, objects, per_shard)
    ]


def _shard_count(ref: ArrayRef) -> int:
    if not ref.shape:
        return 1
    return prod(-(-d // s) for d, s in zip(ref.shape, ref.shard_shape, strict=True))


def _given_stacks(
    logical: list[_Logical], placements: Mapping[str, ArrayRef]
) -> list[tuple[list[int], int]] | None:
    """The stacks ``placements`` give every logical array (in stack-number order), or None
    when they do not place all of them, each in a stack whose layout is its own."""
    if not placements:
        return None
    by_path: dict[str, dict[int, int]] = {}
    per_shard: dict[str, int] = {}
    for number, item in enumerate(logical):
        placed = placements.get(item.name)
        if placed is None or placed.stack is None or _layout_key(placed) != _layout_key(item.ref):
            return None
        by_path.setdefault(placed.path, {})[placed.stack.index] = number
        per_shard[placed.path] = placed.stack.per_shard
    stacks: list[tuple[list[int], int]] = []
    for position, path in enumerate(sorted(by_path, key=lambda p: int(p.rpartition("/")[2]))):
        members = by_path[path]
        if path != stack_array_path(position) or sorted(members) != list(range(len(members))):
            return None
        stacks.append(([members[i] for i in range(len(members))], per_shard[path]))
    return stacks


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


def _units(index: int, array: StoredArray, fragments: list[SourceFragment]) -> Iterator[WriteUnit]:
    fragments = sorted(fragments, key=lambda f: f.start)
    starts = [f.start for f in fragments]
    shape = list(array.shape)
    for region in shard_regions(shape, list(array.shard_shape)):
        start = _flat_start(shape, region)
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
