"""Fill a rank's flat partitions from a store: the framework-neutral half of every loader.

A loader describes what the rank holds as :class:`FlatTarget` objects (one flat buffer per
optimizer group or sub-group, laid out by :mod:`ucformat.layout.partition`); this module turns
them into reads of exactly the flat ranges the rank owns. Two ways:

* :func:`read_flat_state` returns freshly filled tensors; nothing of the caller's state is
  touched, so a failed read leaves the model as it was;
* :func:`can_fill_in_place` checks, before anything is written, that every range is there and
  passes its checksum and that the destination tensor can take the bytes directly; then
  :func:`fill_flat_state` reads the ranges straight into the caller's tensors (no staging
  memory, no second copy);
* :func:`batch_flat_state` puts the same reads as :func:`read_flat_state` into a
  :class:`~ucformat.read.batch.ReadBatch` (read ``once``, job-wide: :mod:`ucformat.read.shared`)
  and gives the tensor once the batch is read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ucformat.format.dtypes import itemsize, storage_to_torch, torch_dtype
from ucformat.format.models import ArrayRef
from ucformat.format.spec import FP32_STATE
from ucformat.format.stacks import StoredArray, describe_ref, placement
from ucformat.layout.chunking import is_flat_chunking
from ucformat.layout.partition import Fragment, PartitionedFlatLayout, PerParamLayout
from ucformat.layout.reads import ReadCost, range_read_cost
from ucformat.read.batch import ReadBatch
from ucformat.read.checkpoint import UniversalCheckpoint
from ucformat.read.staging import DeviceStaging, host_buffer

__all__ = [
    "FlatTarget",
    "ReadTally",
    "batch_flat_state",
    "can_fill_in_place",
    "fill_flat_state",
    "rank_fragments",
    "read_flat_state",
]


@dataclass(frozen=True)
class FlatTarget:
    """One flat partition of the target on this rank.

    Attributes:
        index: the flat group (ZeRO-1/2 param group, ZeRO-3 sub-group) number.
        group: the optimizer param group it belongs to.
        layout: how parameters map onto the flat buffer at the target's world size.
        rank: this rank's index in the partition's process group.
        numel: length of this rank's flat buffer.
    """

    index: int
    group: int
    layout: PartitionedFlatLayout | PerParamLayout
    rank: int
    numel: int

    @property
    def names(self) -> list[str]:
        """Member parameters in flat order."""
        return [slot.name for slot in self.layout.slots]


@dataclass
class ReadTally:
    """Bytes this rank needed (exact ranges), for the over-read report, and the ranges read."""

    bytes_needed: int = 0
    #: The logical arrays read from (by their name in messages: ``stacks/3[4]``).
    arrays: set[str] = field(default_factory=set)
    #: Per stored array path: the stored array and the flat ranges read from it (a stack's
    #: members' ranges at their offsets: its shard indexes are fetched once for all of them).
    ranges: dict[str, tuple[StoredArray, list[tuple[int, int]]]] = field(default_factory=dict)

    def note(self, ref: ArrayRef, start: int, stop: int) -> None:
        """Record that ``[start, stop)`` of ``ref`` is read."""
        self.arrays.add(describe_ref(ref))
        if start < stop:
            stored, offset = placement(ref)
            entry = self.ranges.setdefault(stored.path, (stored, []))
            entry[1].append((offset + start, offset + stop))

    def planned(self) -> ReadCost:
        """What the read-cost model (:mod:`ucformat.layout.reads`) says these ranges cost:
        bytes and requests, shard indexes fetched once per stored array (exact when each
        array is read in one range, as a rank's loads read it; box-chunked arrays: in one read
        of all its ranges)."""
        total = ReadCost(0, 0, 0, 0)
        for ref, ranges in self.ranges.values():
            item = itemsize(ref.dtype)
            together = bool(ref.shape) and not is_flat_chunking(ref.shape, ref.chunk_shape)
            total += range_read_cost(
                ref.shape, ref.chunk_shape, ref.shard_shape, item, ranges, together=together
            )
        return total


def rank_fragments(target: FlatTarget, available: Iterable[str]) -> list[Fragment]:
    """The fragments this rank owns whose parameter the store has."""
    keep = set(available)
    return [f for f in target.layout.fragments(target.rank) if f.name in keep]


def read_flat_state(
    ckpt: UniversalCheckpoint,
    target: FlatTarget,
    fragments: Sequence[Fragment],
    state: str,
    tally: ReadTally,
    dtype: torch.dtype | None = None,
    base: torch.Tensor | None = None,
    pin: bool = False,
) -> torch.Tensor:
    """A new 1-D tensor of ``target.numel`` elements holding ``state`` where the rank owns data.

    Elements outside the fragments (padding, parameters the store lacks) are taken from
    ``base`` (e.g. the live values, so a non-strict load keeps them), else zero.
    ``dtype`` defaults to the stored dtype (``float32`` for ``fp32``). ``pin``: the tensor is
    page-locked host memory (it is bound for a CUDA device: :func:`~ucformat.read.staging.
    wants_pinned`), so its copy there is one DMA and no other host copy is made.
    """
    manifest = ckpt.manifest
    refs, stored_dtype, out = _partition_buffer(ckpt, target, fragments, state, base, pin)
    spans = _spans(fragments)
    for fragment in fragments:
        ref = refs[fragment.name]
        window = out[fragment.partition_start : fragment.partition_start + fragment.length]
        if fragment.name in spans and ref.dtype == stored_dtype:
            continue  # read below, once for all its fragments
        if ref.dtype == stored_dtype:
            ckpt.read_range_into(ref, fragment.param_start, fragment.param_stop, window)
        else:  # e.g. a frozen bf16 param read as fp32
            values = ckpt.read_range(
                manifest.resolve(fragment.name), state, fragment.param_start, fragment.param_stop
            )
            window[:] = values.to(torch.float32).numpy()
        tally.bytes_needed += fragment.length * itemsize(ref.dtype)
        tally.note(ref, fragment.param_start, fragment.param_stop)
    for name, group in spans.items():
        if refs[name].dtype == stored_dtype:
            _read_span(ckpt, refs[name], group, out, tally)
    tensor = storage_to_torch(out, stored_dtype)
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor


def batch_flat_state(
    ckpt: UniversalCheckpoint,
    target: FlatTarget,
    fragments: Sequence[Fragment],
    state: str,
    batch: ReadBatch,
    tally: ReadTally,
    dtype: torch.dtype | None = None,
    base: torch.Tensor | None = None,
    pin: bool = False,
) -> Callable[[], torch.Tensor]:
    """:func:`read_flat_state`, its reads added to ``batch``: call the result once the batch
    has been read for the same tensor (gaps from ``base``, else zero; ``pin``: page-locked)."""
    manifest = ckpt.manifest
    refs, stored_dtype, out = _partition_buffer(ckpt, target, fragments, state, base, pin)
    runs: dict[str, list[tuple[int, int, int]]] = {}
    converted = []  # e.g. a frozen bf16 param read as fp32
    for fragment in fragments:
        ref = refs[fragment.name]
        tally.bytes_needed += fragment.length * itemsize(ref.dtype)
        span = (fragment.param_start, fragment.param_stop)
        if ref.dtype == stored_dtype:
            runs.setdefault(fragment.name, []).append((*span, fragment.partition_start))
        else:
            name = manifest.resolve(fragment.name)
            converted.append((fragment, batch.runs(ckpt, name, state, [(*span, 0)])))
    for name, ranges in runs.items():
        batch.add(refs[name], ranges, out)

    def finish() -> torch.Tensor:
        for fragment, pending in converted:
            window = out[fragment.partition_start : fragment.partition_start + fragment.length]
            window[:] = pending.value().to(torch.float32).numpy()
        tensor = storage_to_torch(out, stored_dtype)
        return tensor.to(dtype) if dtype is not None and tensor.dtype != dtype else tensor

    return finish


def can_fill_in_place(
    ckpt: UniversalCheckpoint,
    target: FlatTarget,
    fragments: Sequence[Fragment],
    state: str,
    dest: torch.Tensor | None,
) -> bool:
    """Whether :func:`fill_flat_state` can read ``state`` straight into ``dest``: a contiguous
    tensor (host, or a device reached through pinned windows) of ``target.numel`` elements in
    the stored dtype, and every range the rank reads present and passing its checksum (checked
    here, in place; nothing is copied or written)."""
    if dest is None or not dest.is_contiguous():
        return False
    if dest.numel() != target.numel:
        return False
    refs = [(f, ckpt.array_ref(f.name, state)) for f in fragments]
    expected = torch_dtype(refs[0][1].dtype) if refs else dest.dtype
    if dest.dtype != expected or any(torch_dtype(ref.dtype) != expected for _, ref in refs):
        return False
    return all(ckpt.check_range(ref, f.param_start, f.param_stop) for f, ref in refs)


def fill_flat_state(
    ckpt: UniversalCheckpoint,
    target: FlatTarget,
    fragments: Sequence[Fragment],
    state: str,
    tally: ReadTally,
    dest: torch.Tensor,
    *,
    keep_gaps: bool,
    staging_window: int | None = None,
) -> None:
    """Read ``state`` into ``dest`` in place (after :func:`can_fill_in_place` said yes).

    Elements outside the fragments keep their values if ``keep_gaps`` (the live fp32 weights),
    else become zero (optimizer states, as :func:`read_flat_state` gives them). A device
    ``dest`` (a CUDA engine's partitions) is filled through two pinned host windows
    (:class:`~ucformat.read.staging.DeviceStaging`): no host copy of its size is made.
    """
    gaps = [] if keep_gaps else _gaps(fragments, target.numel)
    if dest.device.type != "cpu" or staging_window is not None:
        for low, high in gaps:
            dest.detach().reshape(-1)[low:high].zero_()
        _fill_staged(ckpt, fragments, state, tally, dest, staging_window)
        return
    out = dest.detach().numpy() if dest.dtype != torch.bfloat16 else None
    if out is None:  # bfloat16: its bits, as the store holds them
        out = dest.detach().view(torch.int16).numpy().view(np.uint16)
    for low, high in gaps:
        _fill(out, low, high, None)
    spans = _spans(fragments)
    for fragment in fragments:
        if fragment.name in spans:
            continue
        ref = ckpt.array_ref(fragment.name, state)
        window = out[fragment.partition_start : fragment.partition_start + fragment.length]
        ckpt.read_range_into(ref, fragment.param_start, fragment.param_stop, window)
        tally.bytes_needed += fragment.length * itemsize(ref.dtype)
        tally.note(ref, fragment.param_start, fragment.param_stop)
    for name, group in spans.items():
        _read_span(ckpt, ckpt.array_ref(name, state), group, out, tally)


def _fill_staged(
    ckpt: UniversalCheckpoint,
    fragments: Sequence[Fragment],
    state: str,
    tally: ReadTally,
    dest: torch.Tensor,
    window: int | None,
) -> None:
    """:func:`fill_flat_state`'s fragments into a device tensor: each fragment (a
    tensor-parallel span: runs of consecutive fragments) read into a pinned window and copied
    to its place, window by window. ``window``: the windows' bytes (a test drives the staging
    with small windows on a host tensor; None: the default on a device)."""
    flat = dest.detach().reshape(-1)
    if not fragments:
        return
    dtype = ckpt.array_ref(fragments[0].name, state).dtype
    options = {} if window is None else {"window_bytes": window}
    staging = DeviceStaging(flat, dtype, pin=None if window is None else False, **options)
    spans = _spans(fragments)
    for fragment in fragments:
        ref = ckpt.array_ref(fragment.name, state)
        tally.bytes_needed += fragment.length * itemsize(ref.dtype)
        tally.note(ref, fragment.param_start, fragment.param_stop)
        if fragment.name in spans:
            continue
        staging.put_range(
            fragment.partition_start, fragment.length, _range_reader(ckpt, ref, fragment)
        )
    for name, group in spans.items():
        ref = ckpt.array_ref(name, state)
        for piece in _runs_of_consecutive(group, staging.per_window):
            low = piece[0].partition_start
            count = piece[-1].partition_start + piece[-1].length - low
            runs = [(f.param_start, f.param_stop, f.partition_start - low) for f in piece]
            staging.put(low, count, functools.partial(_read_runs, ckpt, ref, runs))
    staging.finish()


def _read_runs(
    ckpt: UniversalCheckpoint, ref: ArrayRef, runs: list[tuple[int, int, int]], out: np.ndarray
) -> None:
    ckpt.read_runs_into(ref, runs, out)


def _range_reader(
    ckpt: UniversalCheckpoint, ref: ArrayRef, fragment: Fragment
) -> Callable[[np.ndarray, int, int], None]:
    """``read(out, at, n)``: elements ``[at, at + n)`` of ``fragment`` into ``out``."""

    def read(out: np.ndarray, at: int, n: int) -> None:
        start = fragment.param_start + at
        ckpt.read_range_into(ref, start, start + n, out)

    return read


def _runs_of_consecutive(group: Sequence[Fragment], limit: int) -> list[list[Fragment]]:
    """``group``'s fragments in partition order, cut into pieces of consecutive fragments
    (each starting where the previous ends) of at most ``limit`` elements; a fragment longer
    than ``limit`` is cut into parts of it."""
    pieces: list[list[Fragment]] = []
    for fragment in sorted(group, key=lambda f: f.partition_start):
        for at in range(0, fragment.length, limit):
            part = (
                fragment
                if fragment.length <= limit
                else replace(
                    fragment,
                    param_start=fragment.param_start + at,
                    partition_start=fragment.partition_start + at,
                    length=min(limit, fragment.length - at),
                )
            )
            last = pieces[-1] if pieces else None
            if (
                last is not None
                and last[-1].partition_start + last[-1].length == part.partition_start
                and part.partition_start + part.length - last[0].partition_start <= limit
            ):
                last.append(part)
            else:
                pieces.append([part])
    return pieces


def _spans(fragments: Sequence[Fragment]) -> dict[str, list[Fragment]]:
    """Parameters with several fragments on this rank (a tensor-parallel shard split on a dim
    other than 0 is one fragment per row): read once as the span that covers them all."""
    by_name: dict[str, list[Fragment]] = {}
    for fragment in fragments:
        by_name.setdefault(fragment.name, []).append(fragment)
    return {name: group for name, group in by_name.items() if len(group) > 1}


def _read_span(
    ckpt: UniversalCheckpoint,
    ref: ArrayRef,
    group: Sequence[Fragment],
    out: np.ndarray,
    tally: ReadTally,
) -> None:
    """Read ``[first start, last stop)`` of ``ref`` once, then copy each fragment's part.

    With box chunks (docs/format.md §2.2) the fragments are read as one read of exactly the
    chunks that hold them, straight into place: a row-parallel slice reads its columns only.
    """
    if ref.shape and not is_flat_chunking(ref.shape, ref.chunk_shape):
        runs = [(f.param_start, f.param_stop, f.partition_start) for f in group]
        ckpt.read_runs_into(ref, runs, out)
        for fragment in group:
            tally.bytes_needed += fragment.length * itemsize(ref.dtype)
            tally.note(ref, fragment.param_start, fragment.param_stop)
        return
    low = min(f.param_start for f in group)
    high = max(f.param_stop for f in group)
    span = np.empty(high - low, dtype=out.dtype)
    ckpt.read_range_into(ref, low, high, span)
    for fragment in group:
        start = fragment.param_start - low
        out[fragment.partition_start : fragment.partition_start + fragment.length] = span[
            start : start + fragment.length
        ]
        tally.bytes_needed += fragment.length * itemsize(ref.dtype)
    tally.note(ref, low, high)


def _partition_buffer(
    ckpt: UniversalCheckpoint,
    target: FlatTarget,
    fragments: Sequence[Fragment],
    state: str,
    base: torch.Tensor | None,
    pin: bool,
) -> tuple[dict[str, ArrayRef], str, np.ndarray]:
    """The fragments' arrays, the dtype the partition is kept in, and a new buffer of the
    partition (``pin``: page-locked) whose elements outside the fragments come from ``base``,
    else are zero."""
    refs = {f.name: ckpt.array_ref(f.name, state) for f in fragments}
    stored = {ref.dtype for ref in refs.values()} or {"float32"}
    if len(stored) != 1:
        raise ValueError(f"state '{state}' has mixed dtypes {sorted(stored)} in one flat group")
    stored_dtype = stored.pop()
    if state == FP32_STATE and stored_dtype != "float32":
        stored_dtype = "float32"
    out = host_buffer(target.numel, stored_dtype, pin=pin)
    filler = (
        None
        if base is None
        else base.detach().to("cpu", torch.float32 if stored_dtype == "float32" else None).numpy()
    )
    for low, high in _gaps(fragments, target.numel):  # from the store, else base, else zero
        _fill(out, low, high, filler)
    return refs, stored_dtype, out


def _gaps(fragments: Sequence[Fragment], numel: int) -> list[tuple[int, int]]:
    """The ranges of a flat partition of ``numel`` elements no fragment covers, in order."""
    gaps: list[tuple[int, int]] = []
    at = 0
    for low, high in sorted((f.partition_start, f.partition_start + f.length) for f in fragments):
        if at < low:
            gaps.append((at, low))
        at = max(at, high)
    if at < numel:
        gaps.append((at, numel))
    return gaps


def _fill(out: np.ndarray, start: int, stop: int, filler: np.ndarray | None) -> None:
    if start < stop:
        out[start:stop] = 0 if filler is None else filler[start:stop]
