"""A rank's reads as data: which flat runs of which arrays go into which buffers.

Every collective loader describes what the rank needs as a :class:`ReadBatch`: items of a
logical array (an :class:`~ucformat.format.models.ArrayRef`), its flat runs ``(start, stop,
at)`` and a 1-D output buffer in the array's storage dtype (elements ``[start, stop)`` go to
``out[at:]``). The batch is then read one of two ways:

* ``own`` (:func:`read_own`): this rank reads every item itself
  (:meth:`~ucformat.read.checkpoint.UniversalCheckpoint.fill`: each chunk an item touches
  fetched once);
* ``once`` (:mod:`ucformat.read.once`): the job reads every chunk once, and each rank gets
  its items' values from whichever rank read them.

Plans are made on *stored* arrays (docs/format.md §2.5): an item of a logical array in a
format-3.1 stack is, to the plan, the runs of the stack at the logical array's offset
(:func:`~ucformat.format.stacks.placement`), so a chunk has one identity however many logical
arrays share its stack or its shard object. The batch holds the buffers; the plans made from
it hold none (:meth:`ReadBatch.needs` gives the stored runs alone). :class:`Placement` puts
values delivered for cells of a stored array into the items that need them (the copies planned
by :mod:`ucformat.layout.cells`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ucformat.format.dtypes import itemsize, storage_to_torch
from ucformat.format.models import ArrayRef
from ucformat.format.spec import FP32_STATE
from ucformat.format.stacks import StoredArray, describe_ref, placement
from ucformat.layout.cells import CellGrid, Copy, NeedList, Rect, cell_grid
from ucformat.read.checkpoint import UniversalCheckpoint
from ucformat.read.staging import host_buffer

__all__ = [
    "Pending",
    "Placement",
    "ReadBatch",
    "ReadItem",
    "add_need",
    "grid_of",
    "read_own",
]

FlatRun = tuple[int, int, int]


@dataclass
class ReadItem:
    """Runs ``(start, stop, at)`` of the logical array ``ref`` that fill ``out`` (1-D, storage
    dtype); ``stored`` holds ``ref`` from flat element ``offset`` on."""

    ref: ArrayRef
    runs: list[FlatRun]
    out: np.ndarray
    stored: StoredArray
    offset: int

    @property
    def elements(self) -> int:
        """Elements the item receives."""
        return sum(stop - start for start, stop, _ in self.runs)

    @property
    def stored_runs(self) -> list[FlatRun]:
        """The runs as runs of the stored array."""
        return [(self.offset + start, self.offset + stop, at) for start, stop, at in self.runs]


@dataclass
class ReadBatch:
    """Everything a rank reads in one load (module docstring)."""

    items: list[ReadItem] = field(default_factory=list)

    def add(self, ref: ArrayRef, runs: Sequence[FlatRun], out: np.ndarray) -> None:
        """Read the flat ``runs`` of ``ref`` into ``out`` (nothing for empty runs)."""
        kept = [(int(a), int(b), int(at)) for a, b, at in runs if a < b]
        if kept:
            self.items.append(ReadItem(ref, kept, out, *placement(ref)))

    def needs(self) -> dict[str, tuple[StoredArray, list[tuple[int, int]]]]:
        """Per stored array path: the stored array and every flat range the batch reads of
        it."""
        out: dict[str, tuple[StoredArray, list[tuple[int, int]]]] = {}
        for item in self.items:
            entry = out.setdefault(item.stored.path, (item.stored, []))
            entry[1].extend((start, stop) for start, stop, _ in item.stored_runs)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of values the batch needs."""
        return sum(item.elements * itemsize(item.ref.dtype) for item in self.items)

    def runs(
        self,
        ckpt: UniversalCheckpoint,
        name: str,
        state: str,
        runs: Sequence[FlatRun],
        *,
        pin: bool = False,
    ) -> Pending:
        """Read the flat ``runs`` of ``state`` of ``name`` into a new 1-D tensor, as
        :meth:`~ucformat.read.checkpoint.UniversalCheckpoint.read_runs` gives them, once the
        batch has been read (``pin``: in page-locked host memory, bound for a CUDA device)."""
        ref = ckpt.array_ref(name, state)
        total = sum(stop - start for start, stop, _ in runs)
        out = host_buffer(total, ref.dtype, pin=pin)
        self.add(ref, runs, out)
        return Pending(out, ref.dtype, state == FP32_STATE)

    def whole(self, ckpt: UniversalCheckpoint, name: str, state: str) -> Pending:
        """Read all of ``state`` of ``name`` (in its shape), as ``ckpt.read`` gives it."""
        ref = ckpt.array_ref(name, state)
        pending = self.runs(ckpt, name, state, [(0, math.prod(ref.shape), 0)])
        pending.shape = tuple(ref.shape)
        return pending


@dataclass
class Pending:
    """A tensor a :class:`ReadBatch` fills: :meth:`value` once the batch has been read."""

    out: np.ndarray
    dtype: str
    fp32: bool
    shape: tuple[int, ...] | None = None

    def value(self) -> torch.Tensor:
        """The values read (``fp32`` states upcast to float32, as the checkpoint reads them)."""
        tensor = storage_to_torch(self.out, self.dtype)
        if self.fp32 and tensor.dtype != torch.float32:
            tensor = tensor.to(torch.float32)
        return tensor if self.shape is None else tensor.reshape(self.shape)


def add_need(needs: dict[str, list[tuple[int, int]]], ref: ArrayRef, start: int, stop: int) -> None:
    """Note in ``needs`` (per stored array path: flat ranges of it) that elements ``[start,
    stop)`` of the logical array ``ref`` are read: the range where the stored array holding
    ``ref`` has them (:func:`~ucformat.format.stacks.placement`)."""
    stored, offset = placement(ref)
    needs.setdefault(stored.path, []).append((offset + start, offset + stop))


def read_own(ckpt: UniversalCheckpoint, batch: ReadBatch) -> None:
    """Read every item of ``batch`` on this rank (each chunk of an item fetched once)."""
    for item in batch.items:
        ckpt.fill(item.ref, item.runs, item.out)


def grid_of(stored: StoredArray) -> CellGrid:
    """The cells of the stored array ``stored`` (:mod:`ucformat.layout.cells`)."""
    return cell_grid(stored.shape, stored.chunk_shape, stored.shard_shape, itemsize(stored.dtype))


def apply(copy: Copy, source: np.ndarray, target: np.ndarray) -> None:
    """Carry out one planned copy from ``source`` (staged values) into ``target``."""
    if copy.rows == 1:
        target[copy.dst : copy.dst + copy.width] = source[copy.src : copy.src + copy.width]
        return
    item = source.itemsize
    src = np.lib.stride_tricks.as_strided(
        source[copy.src :], (copy.rows, copy.width), (copy.src_stride * item, item)
    )
    dst = np.lib.stride_tricks.as_strided(
        target[copy.dst :], (copy.rows, copy.width), (copy.dst_stride * item, item),
        writeable=True,
    )  # fmt: skip
    dst[...] = src


class Placement:
    """The items of a batch by stored array, ready to take values delivered for its cells
    (items of a grid the plan cannot describe, :attr:`~ucformat.layout.cells.CellGrid.
    plannable`, are left out: their rank reads them itself)."""

    def __init__(self, batch: ReadBatch) -> None:
        self._items: dict[str, list[tuple[ReadItem, CellGrid, NeedList]]] = {}
        self.placed: dict[int, int] = {}
        grids: dict[str, CellGrid] = {}
        for item in batch.items:
            grid = grids.get(item.stored.path)
            if grid is None:
                grid = grids[item.stored.path] = grid_of(item.stored)
            if not grid.plannable:
                continue
            runs = item.stored_runs
            needs = grid.out_boxes(runs) if grid.box else runs
            self._items.setdefault(item.stored.path, []).append((item, grid, grid.index(needs)))

    def place(self, path: str, rect: Rect, values: np.ndarray) -> None:
        """Put ``values`` (the staged values of cells ``rect`` of stored array ``path``) into
        every item that needs some of them."""
        for item, grid, needs in self._items.get(path, ()):
            for _, copy in grid.copies(rect, 0, needs):
                apply(copy, values, item.out)
                self.placed[id(item)] = self.placed.get(id(item), 0) + copy.elements

    def missing(self) -> list[str]:
        """Items not wholly placed: ``"<array>: <placed> of <needed> elements"``."""
        return [
            f"{describe_ref(item.ref)}: {self.placed.get(id(item), 0)} of {item.elements} elements"
            for entries in self._items.values()
            for item, _, _ in entries
            if self.placed.get(id(item), 0) != item.elements
        ]
