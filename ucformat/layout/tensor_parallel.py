"""Tensor-parallel shard geometry: where the elements of a rank's shard live in the full tensor.

A tensor-parallel rank holds a *shard* of each parameter: a row-major tensor of ``shard_shape``
assembled from *pieces* of the full (*logical*) tensor. A piece is a block of ``shape`` addressed
twice with an offset and strides (the arguments of ``torch.as_strided``): once in the logical
tensor (``source``) and once in the shard (``dest``); DeepSpeed's affine map has this form.

Everything a loader or converter needs follows from one operation: cut every piece into *runs*,
maximal stretches that are contiguous on both sides (``shard_start``, ``logical_start``,
``length``), and check that a rank's runs tile its shard exactly. A flat range of the shard (a
ZeRO partition's fragment) then maps onto logical flat ranges by interval intersection
(:func:`translate`). A column split (dim 0) is one run per rank; a row split (dim 1) one run per
row; fused sub-parameters one run per sub-parameter (per row, if split on dim 1).

Pure integer arithmetic (stdlib only).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from ucformat.errors import LayoutMismatchError

__all__ = [
    "Piece",
    "Run",
    "ShardMap",
    "row_major_strides",
    "split_pieces",
    "translate",
]


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a contiguous row-major tensor of ``shape``."""
    strides = [1] * len(shape)
    for axis in range(len(shape) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * max(int(shape[axis + 1]), 1)
    return tuple(strides)


@dataclass(frozen=True)
class Piece:
    """A block of ``shape`` at (``source_offset``, ``source_strides``) of the logical tensor and
    (``dest_offset``, ``dest_strides``) of the shard."""

    shape: tuple[int, ...]
    source_offset: int
    source_strides: tuple[int, ...]
    dest_offset: int
    dest_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements the piece covers."""
        return prod(self.shape)


@dataclass(frozen=True)
class Run:
    """Shard flat elements ``[shard_start, shard_start + length)`` are logical flat elements
    ``[logical_start, logical_start + length)``."""

    shard_start: int
    logical_start: int
    length: int


def _piece_runs(piece: Piece) -> list[Run]:
    """The piece cut into runs contiguous in both the shard and the logical tensor."""
    if piece.numel == 0:
        return []
    dims = [
        (size, src, dst)
        for size, src, dst in zip(
            piece.shape, piece.source_strides, piece.dest_strides, strict=True
        )
        if size != 1
    ]
    # Fold trailing dims into the run while both sides stay contiguous.
    run = 1
    while dims and dims[-1][1] == run and dims[-1][2] == run:
        run *= dims.pop()[0]
    runs: list[Run] = []
    count = prod(size for size, _, _ in dims)
    for index in range(count):
        src, dst, rest = piece.source_offset, piece.dest_offset, index
        for size, src_stride, dst_stride in reversed(dims):
            rest, position = divmod(rest, size)
            src += position * src_stride
            dst += position * dst_stride
        runs.append(Run(dst, src, run))
    return runs


@dataclass(frozen=True)
class ShardMap:
    """One rank's shard of one parameter: its shape and its runs, sorted by shard position."""

    logical_shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    runs: tuple[Run, ...]

    @classmethod
    def build(
        cls,
        logical_shape: Sequence[int],
        shard_shape: Sequence[int],
        pieces: Sequence[Piece],
        what: str,
    ) -> ShardMap:
        """Cut ``pieces`` into runs and check that they tile the shard, inside the logical tensor.

        Raises:
            LayoutMismatchError: a gap or overlap in the shard, or a run outside the tensor
                (the message names ``what``).
        """
        logical = tuple(int(d) for d in logical_shape)
        shard = tuple(int(d) for d in shard_shape)
        runs = sorted((r for p in pieces for r in _piece_runs(p)), key=lambda r: r.shard_start)
        total, position = prod(logical), 0
        for run in runs:
            if run.shard_start != position:
                raise LayoutMismatchError(
                    f"{what}: the pieces leave shard elements {position}..{run.shard_start} "
                    f"{'uncovered' if run.shard_start > position else 'covered twice'}; expected "
                    "pieces that tile the shard exactly."
                )
            if run.logical_start < 0 or run.logical_start + run.length > total:
                raise LayoutMismatchError(
                    f"{what}: a piece reaches outside the logical shape {list(logical)}."
                )
            position += run.length
        if position != prod(shard):
            raise LayoutMismatchError(
                f"{what}: the pieces cover {position} elements of a shard of shape {list(shard)} "
                f"({prod(shard)} elements)."
            )
        return cls(logical, shard, tuple(_merge(runs)))

    def translate(self, start: int, length: int) -> list[Run]:
        """Shard flat range ``[start, start + length)`` as runs (``shard_start`` relative to
        ``start``) of the logical tensor."""
        return translate(self.runs, start, length)


def _merge(runs: Sequence[Run]) -> list[Run]:
    merged: list[Run] = []
    for run in runs:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.shard_start + last.length == run.shard_start
            and last.logical_start + last.length == run.logical_start
        ):
            merged[-1] = Run(last.shard_start, last.logical_start, last.length + run.length)
        else:
            merged.append(run)
    return merged


def translate(runs: Sequence[Run], start: int, length: int) -> list[Run]:
    """Intersect shard range ``[start, start + length)`` with ``runs`` (sorted, tiling).

    Returns runs whose ``shard_start`` is relative to ``start``.
    """
    out: list[Run] = []
    stop = start + length
    starts = [r.shard_start for r in runs]
    index = max(bisect_right(starts, start) - 1, 0)
    while index < len(runs) and runs[index].shard_start < stop:
        run = runs[index]
        low, high = max(start, run.shard_start), min(stop, run.shard_start + run.length)
        if low < high:
            out.append(Run(low - start, run.logical_start + low - run.shard_start, high - low))
        index += 1
    return out


def split_pieces(
    logical_shape: Sequence[int], dim: int, widths: Sequence[Sequence[int]]
) -> list[list[Piece]]:
    """Pieces of every rank for a split on ``dim``; ``widths[k][r]`` is rank ``r``'s width of
    sub-parameter ``k`` (one sub-parameter: a plain split). Rank ``r``'s shard is its piece of
    each sub-parameter in order, concatenated on ``dim``."""
    logical = tuple(int(d) for d in logical_shape)
    ranks = len(widths[0]) if widths else 0
    if sum(sum(w) for w in widths) != logical[dim]:
        raise LayoutMismatchError(
            f"widths {[list(w) for w in widths]} sum to {sum(sum(w) for w in widths)}, expected "
            f"{logical[dim]} (dim {dim} of {list(logical)})."
        )
    src_strides = row_major_strides(logical)
    out: list[list[Piece]] = []
    for rank in range(ranks):
        shard = list(logical)
        shard[dim] = sum(w[rank] for w in widths)
        dst_strides = row_major_strides(shard)
        pieces: list[Piece] = []
        sub_start, dest_pos = 0, 0
        for sub in widths:
            width = sub[rank]
            src_pos = sub_start + sum(sub[:rank])
            shape = list(logical)
            shape[dim] = width
            pieces.append(
                Piece(
                    tuple(shape),
                    src_pos * src_strides[dim],
                    src_strides,
                    dest_pos * dst_strides[dim],
                    dst_strides,
                )
            )
            sub_start += sum(sub)
            dest_pos += width
        out.append(pieces)
    return out
