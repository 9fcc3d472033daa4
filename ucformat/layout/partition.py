"""ZeRO partition arithmetic: which rank holds which elements of which parameter.

ZeRO-1/2 (``DeepSpeedZeroOptimizer`` and ``BF16_Optimizer``) flatten each optimizer param group
into one buffer: the group's parameters in optimizer order, each optionally followed by alignment
zeros, then zeros up to a multiple of ``2 * world_size``. The padded length ``T`` splits into
``world_size`` equal partitions of ``P = T / world_size`` elements; rank ``r`` owns
``[r * P, (r + 1) * P)``.

ZeRO-3 partitions every parameter on its own: ``ps = ceil(numel / world_size)``; rank ``r`` owns
elements ``[r * ps, min((r + 1) * ps, numel))`` of the flattened parameter, right-padded to ``ps``.
A rank's flat buffer for a sub-group is the concatenation of its pieces in sub-group order.

Both layouts are described by the same :class:`FlatLayout`: a list of :class:`Slot` (where a
parameter starts in a rank's view) and a rule producing :class:`Fragment` runs. Everything here is
plain integer arithmetic, testable without files, tensors or processes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import gcd

__all__ = [
    "Fragment",
    "PartitionedFlatLayout",
    "PerParamLayout",
    "Slot",
    "alignment_paddings",
    "ceil_div",
    "zero3_sub_groups",
]


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


@dataclass(frozen=True)
class Slot:
    """A parameter's place in a flat layout."""

    name: str
    numel: int
    #: ZeRO-1/2: offset in the group's flat buffer. ZeRO-3: offset in every rank's flat buffer.
    offset: int


@dataclass(frozen=True)
class Fragment:
    """A run of one parameter's flattened elements, held contiguously by one rank."""

    name: str
    rank: int
    #: First element of the flattened parameter.
    param_start: int
    #: Position of that element in the rank's flat partition.
    partition_start: int
    length: int

    @property
    def param_stop(self) -> int:
        """One past the last element of the flattened parameter."""
        return self.param_start + self.length


def alignment_paddings(numels: Sequence[int], element_size: int) -> list[int]:
    """Zeros DeepSpeed inserts after each parameter with ``parameter_alignment=true``.

    Every parameter starts at a multiple of ``16 / gcd(16, element_size)`` elements; the last
    parameter of a group gets no padding (the ``2 * world_size`` tail handles it).
    """
    align = 16 // gcd(16, element_size)
    pads: list[int] = []
    offset = 0
    for index, numel in enumerate(numels):
        offset += numel
        pad = 0 if index == len(numels) - 1 else (-offset) % align
        pads.append(pad)
        offset += pad
    return pads


@dataclass(frozen=True)
class PartitionedFlatLayout:
    """ZeRO-1/2 layout of one optimizer param group at a given data-parallel world size."""

    world_size: int
    slots: tuple[Slot, ...]
    #: Elements holding data or alignment zeros, before the tail padding.
    used: int

    @classmethod
    def build(
        cls,
        params: Sequence[tuple[str, int]],
        world_size: int,
        paddings: Sequence[int] | None = None,
    ) -> PartitionedFlatLayout:
        """Lay out ``params`` (name, numel) in order, with optional per-param alignment zeros."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        pads = list(paddings) if paddings is not None else [0] * len(params)
        if len(pads) != len(params):
            raise ValueError(f"{len(pads)} paddings for {len(params)} params")
        slots: list[Slot] = []
        offset = 0
        for (name, numel), pad in zip(params, pads, strict=True):
            slots.append(Slot(name, numel, offset))
            offset += numel + pad
        return cls(world_size, tuple(slots), offset)

    @property
    def total(self) -> int:
        """Padded flat length ``T``: a multiple of ``2 * world_size``."""
        alignment = 2 * self.world_size
        return ceil_div(self.used, alignment) * alignment

    @property
    def partition_size(self) -> int:
        """``P = T / world_size``, the same for every rank."""
        return self.total // self.world_size

    def rank_range(self, rank: int) -> tuple[int, int]:
        """The flat range ``[r * P, (r + 1) * P)`` owned by ``rank``."""
        size = self.partition_size
        return rank * size, (rank + 1) * size

    def valid_length(self, rank: int) -> int:
        """Elements of ``rank``'s partition before the tail padding starts."""
        start, stop = self.rank_range(rank)
        return max(0, min(stop, self.used) - start)

    def fragments(self, rank: int) -> Iterator[Fragment]:
        """The parameter runs held by ``rank``, in partition order."""
        start, stop = self.rank_range(rank)
        for slot in self.slots:
            lo = max(slot.offset, start)
            hi = min(slot.offset + slot.numel, stop)
            if lo < hi:
                yield Fragment(slot.name, rank, lo - slot.offset, lo - start, hi - lo)

    def all_fragments(self) -> Iterator[Fragment]:
        """Fragments of every rank, rank by rank."""
        for rank in range(self.world_size):
            yield from self.fragments(rank)


@dataclass(frozen=True)
class PerParamLayout:
    """ZeRO-3 layout of one sub-group: each parameter partitioned on its own."""

    world_size: int
    slots: tuple[Slot, ...]

    @classmethod
    def build(cls, params: Sequence[tuple[str, int]], world_size: int) -> PerParamLayout:
        """Lay out ``params`` (name, numel) in sub-group order."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        slots: list[Slot] = []
        offset = 0
        for name, numel in params:
            slots.append(Slot(name, numel, offset))
            offset += ceil_div(numel, world_size)
        return cls(world_size, tuple(slots))

    def piece_size(self, numel: int) -> int:
        """``ps = ceil(numel / world_size)``: each rank's padded piece of a parameter."""
        return ceil_div(numel, self.world_size)

    @property
    def partition_size(self) -> int:
        """Length of every rank's flat buffer: the sum of the pieces."""
        return sum(self.piece_size(slot.numel) for slot in self.slots)

    def fragments(self, rank: int) -> Iterator[Fragment]:
        """The non-padding runs held by ``rank``, in partition order."""
        for slot in self.slots:
            piece = self.piece_size(slot.numel)
            lo = rank * piece
            hi = min(lo + piece, slot.numel)
            if lo < hi:
                yield Fragment(slot.name, rank, lo, slot.offset, hi - lo)

    def all_fragments(self) -> Iterator[Fragment]:
        """Fragments of every rank, rank by rank."""
        for rank in range(self.world_size):
            yield from self.fragments(rank)


def zero3_sub_groups(
    params: Sequence[tuple[str, int]], world_size: int, sub_group_size: int
) -> list[list[str]]:
    """Split one param group into ZeRO-3 sub-groups, as DeepSpeed does.

    Parameters accumulate in order by their per-rank piece size; a sub-group closes as soon as
    its accumulated size reaches ``sub_group_size``, and at the group's last parameter.
    """
    groups: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, numel in params:
        current.append(name)
        size += ceil_div(numel, world_size)
        if size >= sub_group_size:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups
