"""Megatron-Core's distributed-optimizer buckets: where each parameter sits in a bucket.

Megatron's DDP lays every model chunk's trainable parameters of one (param dtype, grad dtype)
out in one flat *buffer*, in **reverse** module order, cut into *buckets*. With the distributed
optimizer (Megatron-Core 0.16.1, ``param_and_grad_buffer.py``):

* every parameter starts at a multiple of :data:`PARAM_ALIGN` (64) elements of the buffer;
* a bucket closes after the parameter that brings it to ``bucket_size`` elements (none: one
  bucket), and a parameter marked ``shared_embedding`` (the tied embedding of a pipeline's
  first and last stages) gets a bucket of its own: the open bucket closes before it (at its
  aligned start) and its own bucket closes right after it;
* a bucket's *unpadded* size runs from its start to where it closed; its *padded* size rounds
  that up to a multiple of ``lcm(dp, 128)`` (``pad_buckets_for_high_nccl_busbw``: also of
  2**16), and the next bucket starts there.

The ``dp_reshardable`` checkpoint format saves, per bucket and optimizer state, one tensor of
the bucket's unpadded size whose element ``i`` is bucket element ``i`` (every data-parallel
rank wrote its slice at its bucket offset), and it records every bucket's unpadded and padded
size. :func:`place_params` inverts the rule above from those recorded sizes, so it needs
neither the bucket size nor the data-parallel size the job ran with; :func:`bucket_sizes` is
the rule itself (what a job with a given bucket size records).

:func:`local_runs` and :func:`cut_runs` map a range of a parameter's *local* tensor (the rank's
boxes of the full tensor, one after another, each row-major: a TP shard, SwiGLU's gate then up
half) to runs of the full tensor's flat elements.

Pure integer arithmetic (stdlib only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ucformat.errors import LayoutMismatchError
from ucformat.layout.boxes import Run, chunk_runs

__all__ = [
    "PARAM_ALIGN",
    "BucketParam",
    "BucketSlot",
    "bucket_sizes",
    "cut_runs",
    "local_runs",
    "place_params",
]

#: Every parameter of a distributed optimizer's buffer starts at a multiple of this many elements.
PARAM_ALIGN = 64


@dataclass(frozen=True)
class BucketParam:
    """One parameter of a buffer, in buffer order: its element count and whether Megatron gives
    it a bucket of its own (``shared_embedding``)."""

    numel: int
    own_bucket: bool = False


@dataclass(frozen=True)
class BucketSlot:
    """Where a parameter sits: elements ``[start, stop)`` of bucket ``bucket``."""

    bucket: int
    start: int
    stop: int


def _align(index: int, divisor: int) -> int:
    return -(-index // divisor) * divisor


def bucket_sizes(
    params: Sequence[BucketParam],
    bucket_size: int | None,
    data_parallel: int,
    *,
    high_busbw_padding: bool = False,
) -> tuple[list[BucketSlot], list[int], list[int]]:
    """Megatron's rule forward: the slots, unpadded and padded bucket sizes of a buffer of
    ``params`` (buffer order) with ``bucket_size`` (None: unbounded) at ``data_parallel``."""
    divisor = math.lcm(data_parallel, 128, 2**16 if high_busbw_padding else 1)
    slots: list[BucketSlot] = []
    unpadded: list[int] = []
    padded: list[int] = []
    bucket_start = position = 0
    members = 0

    def close(end: int) -> int:
        nonlocal bucket_start, members
        unpadded.append(end - bucket_start)
        padded_end = _align(end, divisor)
        padded.append(padded_end - bucket_start)
        bucket_start, members = padded_end, 0
        return padded_end

    for param in params:
        position = _align(position, PARAM_ALIGN)
        if param.own_bucket and members:
            position = close(position)
        end = position + param.numel
        slots.append(BucketSlot(len(unpadded), position - bucket_start, end - bucket_start))
        members += 1
        full = bucket_size is not None and end - bucket_start >= bucket_size
        position = close(end) if full or param.own_bucket else end
    if members:
        close(position)
    return slots, unpadded, padded


def place_params(
    params: Sequence[BucketParam], unpadded: Sequence[int], padded: Sequence[int]
) -> list[BucketSlot]:
    """Each parameter's slot, from the buffer's recorded bucket sizes (the rule inverted).

    Raises:
        LayoutMismatchError: the parameters do not fill the recorded buckets by Megatron's rule
            (another parameter order, another set of parameters, or another Megatron version).
    """
    if len(unpadded) != len(padded):
        raise LayoutMismatchError(
            f"{len(unpadded)} unpadded but {len(padded)} padded bucket sizes recorded."
        )
    for index, (size, total) in enumerate(zip(unpadded, padded, strict=True)):
        if not 0 <= size <= total:
            raise LayoutMismatchError(
                f"bucket {index} records {size} unpadded elements in {total} padded ones."
            )
    slots: list[BucketSlot] = []
    bucket = bucket_start = position = members = 0

    def close(end: int, why: str) -> int:
        nonlocal bucket, bucket_start, members
        if bucket >= len(unpadded) or end - bucket_start != unpadded[bucket]:
            recorded = unpadded[bucket] if bucket < len(unpadded) else "none"
            raise LayoutMismatchError(
                f"bucket {bucket} would close {why} after {end - bucket_start} elements; the "
                f"checkpoint records {recorded}."
            )
        bucket_start += padded[bucket]
        bucket, members = bucket + 1, 0
        return bucket_start

    for index, param in enumerate(params):
        if bucket >= len(unpadded):
            raise LayoutMismatchError(
                f"parameter {index} of {len(params)} ({param.numel} elements) falls after the "
                f"last of the {len(unpadded)} recorded buckets."
            )
        position = _align(position, PARAM_ALIGN)
        if param.own_bucket and members:
            position = close(position, f"before parameter {index} (its own bucket)")
        end = position + param.numel
        slots.append(BucketSlot(bucket, position - bucket_start, end - bucket_start))
        members += 1
        if param.own_bucket or end - bucket_start >= unpadded[bucket]:
            position = close(end, f"at parameter {index}")
        else:
            position = end
    if members:
        close(position, "at the last parameter")
    if bucket != len(unpadded):
        raise LayoutMismatchError(
            f"{len(params)} parameters fill {bucket} buckets; the checkpoint records "
            f"{len(unpadded)}."
        )
    return slots


def local_runs(
    shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> list[Run]:
    """A local tensor made of ``boxes`` ``(offsets, sizes)`` of a full tensor of ``shape``, one
    after another: its runs (``chunk_start`` counts local elements)."""
    runs: list[Run] = []
    base = 0
    for offsets, sizes in boxes:
        for run in chunk_runs(tuple(shape), tuple(offsets), tuple(sizes)):
            runs.append(Run(run.start, base + run.chunk_start, run.length))
        base += math.prod(sizes)
    return runs


def cut_runs(runs: Sequence[Run], start: int, stop: int) -> list[Run]:
    """The parts of ``runs`` whose local elements fall in ``[start, stop)``, with
    ``chunk_start`` counted from ``start``."""
    out: list[Run] = []
    for run in runs:
        low = max(start, run.chunk_start)
        high = min(stop, run.chunk_start + run.length)
        if low < high:
            shift = low - run.chunk_start
            out.append(Run(run.start + shift, low - start, high - low))
    return out
