"""Cutting a full tensor for another tensor-parallel degree, by the rule its split followed.

A split recorded at degree ``T`` (``dim``, and per sub-parameter its size and per-rank widths)
says which indices of ``dim`` each rank held. Re-cutting it at degree ``T'`` needs the *rule*
that chose those widths. The one rule this module knows is the near-even split DeepSpeed's
AutoTP uses when nothing coarser applies: of ``n`` indices over ``T`` ranks, rank ``r`` holds
``n // T`` plus one more if ``r < n % T``, consecutive, in rank order; each sub-parameter of a
fused tensor (q, k, v; gate, up) is split by it separately and rank ``r``'s pieces are
concatenated in sub-parameter order (:func:`ucformat.layout.tensor_parallel.split_pieces`).
:func:`near_even` checks that recorded widths follow it; a split that does not (head- or
grain-granular widths) cannot be re-cut from what is recorded.

Pure integer arithmetic (stdlib only).
"""

from __future__ import annotations

from collections.abc import Sequence

from ucformat.layout.tensor_parallel import Piece, row_major_strides, split_pieces

__all__ = ["near_even", "near_even_widths", "recut_split", "whole_pieces"]


def near_even_widths(size: int, degree: int) -> list[int]:
    """Per rank, its extent of ``size`` indices split near-evenly over ``degree`` ranks."""
    base, extra = divmod(size, degree)
    return [base + (1 if rank < extra else 0) for rank in range(degree)]


def near_even(size: int, widths: Sequence[int]) -> bool:
    """Whether ``widths`` is the near-even split of ``size`` over ``len(widths)`` ranks."""
    return bool(widths) and list(widths) == near_even_widths(size, len(widths))


def whole_pieces(logical_shape: Sequence[int]) -> list[Piece]:
    """The one piece of a rank that holds the whole tensor."""
    shape = tuple(int(d) for d in logical_shape)
    strides = row_major_strides(shape)
    return [Piece(shape, 0, strides, 0, strides)]


def recut_split(
    logical_shape: Sequence[int], dim: int, sub_sizes: Sequence[int], degree: int
) -> list[tuple[tuple[int, ...], list[Piece]]]:
    """Per rank at ``degree``: (shard shape, pieces) of a near-even split on ``dim`` of each
    sub-parameter (``sub_sizes`` along ``dim``, in order; one entry: a plain split)."""
    widths = [near_even_widths(int(size), degree) for size in sub_sizes]
    out: list[tuple[tuple[int, ...], list[Piece]]] = []
    for rank, pieces in enumerate(split_pieces(logical_shape, dim, widths)):
        shape = [int(d) for d in logical_shape]
        shape[dim] = sum(w[rank] for w in widths)
        out.append((tuple(shape), pieces))
    return out
