"""An array's chunks as cells of a grid: what a rank needs, what a reader reads, what moves.

Read-once loads (:mod:`ucformat.layout.read_once`) plan in chunks, the store's unit of reads:
a rank that needs one element of a chunk fetches the whole chunk. A grid is that of a *stored*
array (docs/format.md §2.5: a format-3.1 stack ``(N, d_1, ..)`` in chunks ``(1, c_1, ..)``, or
an older store's array itself), so a chunk's cell is its storage identity: two logical arrays
of one stack are two parts of one grid, and a shard object holding several of them is one
shard of it. This module maps between the three views of one stored array:

* **elements**, as the loaders ask for them: flat runs ``(start, stop, at)`` (elements
  ``[start, stop)`` go to ``out[at:]``) or, for a matrix, boxes of it (:class:`OutBox`);
* **cells**: the chunks, in a grid of ``(rows, cols)`` cells; a set of them is a list of
  :data:`Rect` ``(i0, i1, j0, j1)`` of cell rows and cell columns. Shards are always whole
  consecutive cell rows (:meth:`CellGrid.shard_of`), so a shard is a rect too;
* **staging**: the values of one rect, as a reader reads them and as they travel: the rect's
  element box in row-major order (:meth:`CellGrid.region_runs`).

Two kinds of grid, one interface (:class:`CellGrid`):

* flat-contiguous chunks (every array but box-chunked matrices; docs/format.md §2.2), a stack
  of them included: every chunk is one flat range of the array, numbered in row-major order of
  the chunk grid, and consecutive chunks hold consecutive ranges; the cells are a column of
  ``n`` rows (cell ``k`` is row ``k``), a rect's elements one flat range;
* box chunks of a matrix ``(R, C)`` in chunks ``(r, c)``, or of a stack of them ``(N, R, C)``
  in chunks ``(1, r, c)``: the array is seen as the matrix ``(N * R, C)``; its cell rows are
  the chunk rows of every matrix in turn (each matrix's last one clipped to it), its cell
  columns the chunk columns, a rect's elements one box of that matrix.

Everything here is integer arithmetic on the array's shape, chunk and shard shapes (standard
library only); the copies it plans (:class:`Copy`) are executed by the reader.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from ucformat.layout.chunking import is_flat_chunking
from ucformat.layout.partition import ceil_div
from ucformat.layout.ranges import flat_range_to_boxes, union_cover

__all__ = [
    "Copy",
    "CellGrid",
    "OutBox",
    "Rect",
    "NeedList",
    "cell_grid",
]

#: Cell rows ``[i0, i1)`` and cell columns ``[j0, j1)`` of a grid.
Rect = tuple[int, int, int, int]


@dataclass(frozen=True)
class OutBox:
    """Elements of a matrix, rows ``[y0, y1)`` x columns ``[x0, x1)``, wanted in an output
    buffer: element ``(y, x)`` goes to ``out[at + (y - y0) * stride + (x - x0)]``."""

    y0: int
    y1: int
    x0: int
    x1: int
    at: int
    stride: int


@dataclass(frozen=True)
class Copy:
    """``rows`` rows of ``width`` elements: row ``t`` from ``src + t * src_stride`` of a
    staging buffer to ``dst + t * dst_stride`` of an output buffer."""

    src: int
    src_stride: int
    dst: int
    dst_stride: int
    rows: int
    width: int

    @property
    def elements(self) -> int:
        """Elements copied."""
        return self.rows * self.width


#: A need of one output buffer: runs ``(start, stop, at)`` (flat grids) or boxes (box grids).
Needs = Sequence[tuple[int, int, int]] | Sequence[OutBox]


@dataclass(frozen=True)
class CellGrid:
    """The chunks of one array as a grid of cells (module docstring).

    Attributes:
        shape: the array's shape.
        chunk_shape: its inner chunk shape.
        shard_shape: its shard shape (a whole number of chunks).
        itemsize: bytes per element.
    """

    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    itemsize: int
    box: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "box", len(self.shape) >= 2 and not is_flat_chunking(self.shape, self.chunk_shape)
        )

    # --- the grid -----------------------------------------------------------------------------
    @cached_property
    def numel(self) -> int:
        """Elements of the array."""
        return math.prod(self.shape)

    @cached_property
    def plannable(self) -> bool:
        """Whether the cells describe the array: flat chunks, or box chunks of one leading
        extent before the last two dimensions (a matrix, or a stack of matrices: ``(N, R, C)``
        in chunks ``(1, r, c)``) whose shards hold whole rows. A grid that is not (box chunks
        of a deeper shape, which no writer of ucformat makes) is read by its own readers."""
        if not self.box:
            return True
        whole_rows = min(self.shard_shape[-1], self.shape[-1]) == self.shape[-1]
        return whole_rows and all(c == 1 for c in self.chunk_shape[:-2])

    @cached_property
    def _chunk_grid(self) -> tuple[int, ...]:
        return tuple(ceil_div(d, c) for d, c in zip(self.shape, self.chunk_shape, strict=True))

    @cached_property
    def _row_grid(self) -> CellGrid:
        """A box grid's cell rows as a flat grid: the array's every dimension but the last
        (chunked ``(1, .., 1, r)``: flat-contiguous), so that its cell ``k`` is this grid's cell
        row ``k`` and its elements are the rows of the array seen as a matrix
        ``(numel / cols, cols)``: cell row ``k`` holds matrix rows ``[start(k), start(k + 1))``
        (a stack's matrices one after another, each one's last chunk row clipped to it), and
        its shards are this grid's."""
        return CellGrid(self.shape[:-1], self.chunk_shape[:-1], self.shard_shape[:-1], 1)

    @cached_property
    def rows(self) -> int:
        """Cell rows: chunk rows of a box grid (over every leading index), every chunk of a
        flat grid."""
        if self.box:
            return self._row_grid.rows
        return math.prod(self._chunk_grid) if self.numel else 0

    @cached_property
    def cols(self) -> int:
        """Cell columns (1 for a flat grid)."""
        return self._chunk_grid[-1] if self.box else 1

    @cached_property
    def _split_dim(self) -> int:
        per = [s // c for s, c in zip(self.shard_shape, self.chunk_shape, strict=True)]
        cut = 0
        while cut < len(per) - 1 and per[cut] == 1:
            cut += 1
        return cut

    def shard_of(self, row: int) -> tuple[int, int]:
        """The cell rows ``[lo, hi)`` of the shard holding cell row ``row``."""
        if self.box:
            return self._row_grid.shard_of(row)
        if not self.shape:
            return row, row + 1
        # flat grid: a shard's chunks are consecutive, but a shard may end early where its
        # block overhangs the chunk grid at the split dimension
        grid, cut = self._chunk_grid, self._split_dim
        inner = math.prod(grid[cut + 1 :])
        per = self.shard_shape[cut] // self.chunk_shape[cut]
        outer, rest = divmod(row, grid[cut] * inner)
        along = rest // inner // per * per
        base = outer * grid[cut] * inner
        return base + along * inner, base + min(along + per, grid[cut]) * inner

    def chunk_rects(self, rect: Rect) -> list[tuple[tuple[int, int], ...]]:
        """The chunks of ``rect``'s cells as rects of the array's chunk grid (per dimension
        ``(lo, hi)`` of chunk coordinates), at most ``2 * ndim - 1`` of them."""
        i0, i1, j0, j1 = rect
        if not self.shape:
            return [()] if i0 < i1 else []
        rows = self._row_grid._chunk_grid if self.box else self._chunk_grid
        tail = ((j0, j1),) if self.box else ()
        return [
            (*((part.start, part.stop) for part in box), *tail)
            for box in flat_range_to_boxes(rows, i0, i1)
        ]

    def shard_index_bytes(self) -> int:
        """Bytes of one shard's index (16 per chunk slot, plus a crc32c)."""
        if not self.shape:
            return 0
        slots = math.prod(s // c for s, c in zip(self.shard_shape, self.chunk_shape, strict=True))
        return 16 * slots + 4

    # --- elements of cells --------------------------------------------------------------------
    def _flat_start(self, row: int) -> int:
        """First element of flat-grid cell ``row`` (``numel`` past the last)."""
        if row >= self.rows:
            return self.numel
        coords = _unravel(row, self._chunk_grid)
        index = 0
        for dim, coord, size in zip(self.shape, coords, self.chunk_shape, strict=True):
            index = index * dim + coord * size
        return index

    def _flat_cell(self, element: int) -> int:
        """The flat-grid cell holding ``element``."""
        coords = _unravel(element, self.shape)
        cell = 0
        for coord, size, extent in zip(coords, self.chunk_shape, self._chunk_grid, strict=True):
            cell = cell * extent + coord // size
        return cell

    def box_of(self, rect: Rect) -> tuple[int, int, int, int]:
        """The element box ``(y0, y1, x0, x1)`` of a box-grid rect, in the array seen as a
        matrix of its last dimension's columns (:attr:`_row_grid`)."""
        i0, i1, j0, j1 = rect
        rows, cols, c = self._row_grid, self.shape[-1], self.chunk_shape[-1]
        return rows._flat_start(i0), rows._flat_start(i1), j0 * c, min(j1 * c, cols)

    def elements(self, rect: Rect) -> int:
        """Elements of the cells of ``rect`` (clipped to the array)."""
        if self.box:
            y0, y1, x0, x1 = self.box_of(rect)
            return (y1 - y0) * (x1 - x0)
        return self._flat_start(rect[1]) - self._flat_start(rect[0])

    def nbytes(self, rect: Rect) -> int:
        """Bytes of the values of ``rect``'s cells."""
        return self.elements(rect) * self.itemsize

    def stored_bytes(self, cells: int) -> int:
        """Bytes ``cells`` whole chunks take in a shard object (padded chunks, crc32c each)."""
        return cells * (math.prod(self.chunk_shape) * self.itemsize + 4)

    # --- needs as cells -----------------------------------------------------------------------
    def out_boxes(self, runs: Iterable[tuple[int, int, int]]) -> list[OutBox]:
        """Flat runs of a box-grid matrix as boxes, consecutive rows of one column block
        merged (a ``Shard(1)`` local shard, one run per row, is one box)."""
        cols = self.shape[-1]
        boxes: list[list[int]] = []  # [y0, y1, x0, x1, at, stride]: OutBox's fields
        for start, stop, at in runs:
            while start < stop:
                y, x = divmod(start, cols)
                if x == 0 and stop - start >= cols:  # whole rows
                    count = (stop - start) // cols
                    piece = [y, y + count, 0, cols, at, cols]
                    length = count * cols
                else:
                    end = min(stop, (y + 1) * cols)
                    length = end - start
                    piece = [y, y + 1, x, x + length, at, length]
                last = boxes[-1] if boxes else None
                if (
                    last is not None
                    and last[2] == piece[2]
                    and last[3] == piece[3]
                    and last[1] == piece[0]
                    and last[5] == last[3] - last[2] == piece[5]
                    and piece[4] == last[4] + (last[1] - last[0]) * last[5]
                ):
                    last[1] = piece[1]  # the next rows of the same column block
                else:
                    boxes.append(piece)
                start += length
                at += length
        return [OutBox(*box) for box in boxes]

    def need_rects(self, needs: Needs) -> list[Rect]:
        """The cells holding any element of ``needs`` (runs for a flat grid, boxes for a box
        grid): disjoint rects, each within one shard."""
        if self.box:
            row_of, c = self._row_grid._flat_cell, self.chunk_shape[-1]
            cover = union_cover(
                ((row_of(box.y0), row_of(box.y1 - 1) + 1), (box.x0 // c, (box.x1 - 1) // c + 1))
                for box in needs
                if isinstance(box, OutBox) and box.y0 < box.y1 and box.x0 < box.x1
            )
            rects = [(a, b, c0, c1) for (a, b), (c0, c1) in cover]
        else:
            spans = sorted(
                (self._flat_cell(run[0]), self._flat_cell(run[1] - 1) + 1)
                for run in needs
                if not isinstance(run, OutBox) and run[0] < run[1]
            )
            merged: list[list[int]] = []
            for lo, hi in spans:
                if merged and lo <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], hi)
                else:
                    merged.append([lo, hi])
            rects = [(lo, hi, 0, 1) for lo, hi in merged]
        return [piece for rect in sorted(rects) for piece in self._by_shard(rect)]

    def _by_shard(self, rect: Rect) -> list[Rect]:
        i0, i1, j0, j1 = rect
        out: list[Rect] = []
        while i0 < i1:
            _, hi = self.shard_of(i0)
            out.append((i0, min(hi, i1), j0, j1))
            i0 = min(hi, i1)
        return out

    # --- staging and copies -------------------------------------------------------------------
    def region_runs(self, rect: Rect, at: int) -> list[tuple[int, int, int]]:
        """Flat runs ``(start, stop, at)`` that read ``rect``'s values into staging at ``at``,
        in the staging layout (the rect's box, row-major; a flat grid's range as it is)."""
        if not self.box:
            start, stop = self._flat_start(rect[0]), self._flat_start(rect[1])
            return [(start, stop, at)] if start < stop else []
        y0, y1, x0, x1 = self.box_of(rect)
        cols = self.shape[-1]
        if x0 == 0 and x1 == cols:
            return [(y0 * cols, y1 * cols, at)]
        width = x1 - x0
        return [(y * cols + x0, y * cols + x1, at + (y - y0) * width) for y in range(y0, y1)]

    def block_runs(self, rects: Sequence[Rect]) -> list[tuple[int, int, int]]:
        """:meth:`region_runs` of ``rects`` staged one after another (a reader's block), runs
        that continue each other in the array and in staging joined."""
        runs: list[tuple[int, int, int]] = []
        at = 0
        for rect in rects:
            for start, stop, where in self.region_runs(rect, at):
                last = runs[-1] if runs else None
                if last is not None and last[1] == start and last[2] + last[1] - last[0] == where:
                    runs[-1] = (last[0], stop, last[2])
                else:
                    runs.append((start, stop, where))
            at += self.elements(rect)
        return runs

    def index(self, needs: Needs) -> NeedList:
        """``needs`` sorted for :meth:`copies` (by start, or by first row)."""
        if self.box:
            boxes = sorted((b for b in needs if isinstance(b, OutBox)), key=lambda b: b.y0)
            return NeedList(boxes, [b.y0 for b in boxes], _reach(b.y1 for b in boxes))
        runs = sorted((r[0], r[1], r[2]) for r in needs if not isinstance(r, OutBox))
        return NeedList(runs, [r[0] for r in runs], _reach(r[1] for r in runs))

    def copies(self, rect: Rect, at: int, needs: NeedList) -> list[tuple[int, Copy]]:
        """What of ``rect``'s staged values (at ``at``) goes where: ``(need position, Copy)``
        for every need of ``needs`` (:meth:`index`) overlapping the rect."""
        out: list[tuple[int, Copy]] = []
        if not self.box:
            low, high = self._flat_start(rect[0]), self._flat_start(rect[1])
            for index in needs.overlapping(low, high):
                start, stop, where = needs.items[index]  # type: ignore[misc]
                lo, hi = max(start, low), min(stop, high)
                if lo < hi:
                    out.append((index, Copy(at + lo - low, 0, where + lo - start, 0, 1, hi - lo)))
            return out
        y0, y1, x0, x1 = self.box_of(rect)
        width = x1 - x0
        for index in needs.overlapping(y0, y1):
            box = needs.items[index]
            assert isinstance(box, OutBox)
            ya, yb = max(y0, box.y0), min(y1, box.y1)
            xa, xb = max(x0, box.x0), min(x1, box.x1)
            if ya < yb and xa < xb:
                src = at + (ya - y0) * width + (xa - x0)
                dst = box.at + (ya - box.y0) * box.stride + (xa - box.x0)
                out.append((index, Copy(src, width, dst, box.stride, yb - ya, xb - xa)))
        return out

    def offset_in(self, atom: Rect, rect: Rect) -> int:
        """Where ``rect`` (whole cell rows of ``atom``: :meth:`sub_rects`) starts in ``atom``'s
        staged values, in elements."""
        if self.box:
            return (self.box_of(rect)[0] - self.box_of(atom)[0]) * (
                self.box_of(atom)[3] - self.box_of(atom)[2]
            )
        return self._flat_start(rect[0]) - self._flat_start(atom[0])

    def sub_rects(self, rect: Rect, max_bytes: int) -> list[Rect]:
        """``rect`` cut at cell-row boundaries into pieces of at most ``max_bytes`` (at least
        one cell row each); each piece's staged values are a contiguous slice of the rect's."""
        i0, i1, j0, j1 = rect
        if self.nbytes(rect) <= max_bytes or i1 - i0 == 1:
            return [rect]
        pieces: list[Rect] = []
        start = i0
        while start < i1:
            stop = start + 1
            while stop < i1 and self.nbytes((start, stop + 1, j0, j1)) <= max_bytes:
                stop += 1
            pieces.append((start, stop, j0, j1))
            start = stop
        return pieces


@dataclass(frozen=True)
class NeedList:
    """Needs sorted by where they start, with the furthest each prefix reaches (so that the
    needs overlapping a span are found by bisection even where needs overlap each other)."""

    items: Sequence[tuple[int, int, int]] | Sequence[OutBox]
    starts: list[int]
    reach: list[int]

    def overlapping(self, low: int, high: int) -> range:
        """Positions of the needs that may overlap ``[low, high)`` (a superset; in order)."""
        first = bisect.bisect_right(self.reach, low)
        last = bisect.bisect_left(self.starts, high)
        return range(first, last)


def _unravel(index: int, extents: Sequence[int]) -> list[int]:
    """The coordinates of flat ``index`` in a row-major grid of ``extents``."""
    coords: list[int] = []
    for extent in reversed(extents):
        coords.append(index % extent)
        index //= extent
    coords.reverse()
    return coords


def _reach(stops: Iterable[int]) -> list[int]:
    out: list[int] = []
    furthest = -1
    for stop in stops:
        furthest = max(furthest, stop)
        out.append(furthest)
    return out


def cell_grid(
    shape: Sequence[int], chunk_shape: Sequence[int], shard_shape: Sequence[int], itemsize: int
) -> CellGrid:
    """The :class:`CellGrid` of an array."""
    return CellGrid(tuple(shape), tuple(chunk_shape), tuple(shard_shape), itemsize)
