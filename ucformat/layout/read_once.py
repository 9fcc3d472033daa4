"""Read once, job-wide: which rank reads which chunks from storage, and who gets them from it.

Every rank of a collective load knows what it needs (its *demands*: per array, the cells of
:mod:`ucformat.layout.cells` holding its elements, as rects within one shard each). The plan
gives every needed chunk exactly one reader, preferably a rank that needs it, and tells every
other rank that needs the chunk where it comes from. It is computed in pieces, so that no rank
ever holds the whole job's needs:

1. **homes**: each shard of each array has a home rank (:func:`home_of`, a hash of the array
   and the shard: spread over the ranks). Each rank sends its demands to their shards' homes
   (one all-to-all);
2. each home plans its shards (:func:`plan_home`) from the demands it received, alone:

   * the shard's cells are split into *atoms*, rects of cells that the same set of ranks
     needs (ranks with the same demands counted as one class, so a shard every rank needs
     costs the same as one a single rank needs);
   * atoms, in row-major order, are joined into *blocks*: the next atom joins the block when
     some rank needs both (so a ZeRO partition's boundary chunk goes with the rank that needs
     the rest of it), or while the block is still too small to be worth a shard index of its
     own (``min_bytes``: the index is fetched once per reader and shard), up to ``max_bytes``
     (the unit of balance);
   * each block gets one reader: among the ranks that need at least half as many of its cells
     as the one needing most (a partition's boundary chunk goes with the partition), the one
     this home has given the fewest bytes so far, ties broken by a hash of the block and the
     rank (ranks in the same position of every parameter must not all win);
   * replies (one more all-to-all): the reader gets ``READ`` rows (the block's atoms) and a
     ``SEND`` row per atom and rank needing it (itself included), every other rank needing an
     atom a ``RECV`` row naming the reader;

3. the moves go in **rounds** (:func:`schedule`): the bytes from rank ``q`` to rank ``r`` are
   the atoms both list, in the same order on both sides, cut at cell rows into rounds of at
   most :func:`pair_cap` bytes; a rank's memory per round is at most ``budget`` (half sent,
   half received) whatever the number of its peers, and the two ends of every pair compute the
   same rounds without telling each other.

A home's work grows with the demands it receives (about ``demands / W`` per rank on average),
a rank's with its own demands and rows; nothing grows with ranks x arrays, except at the home
of a shard that many ranks need in many separate pieces, whose work grows with those ranks x
pieces (docs/design.md, "Read once, job-wide": relaying down a tree is not built). The planning is
pure: integers in, integers out (the executor, :mod:`ucformat.read.once`, moves the bytes).
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ucformat.layout.cells import CellGrid, OutBox, Rect
from ucformat.layout.reads import ReadCost, chunk_rects_read_cost, range_read_cost

__all__ = [
    "RECV",
    "READ",
    "SEND",
    "BlockPolicy",
    "Demand",
    "HomePlan",
    "NeedItems",
    "Piece",
    "Row",
    "ShardNeeds",
    "home_of",
    "pair_cap",
    "group_ranks",
    "plan_home",
    "plan_shards",
    "rank_demands",
    "reads_cost",
    "schedule",
    "shard_needs",
]

#: Row kinds of a reply.
READ, SEND, RECV = 0, 1, 2
_new = tuple.__new__


@dataclass(frozen=True)
class Demand:
    """Rank ``rank`` needs the cells ``rect`` (within one shard) of array ``array``."""

    rank: int
    array: int
    rect: Rect


class Row(NamedTuple):
    """One line of a rank's part of the plan (a tuple of eight integers: what travels).

    ``READ``: fetch ``rect`` of ``array`` from storage (``block`` groups the rects read
    together: one read of a block's atoms); ``SEND``: give ``rect`` to ``peer`` (this rank
    itself: place it in its own buffers); ``RECV``: get ``rect`` from ``peer``.
    """

    kind: int
    array: int
    i0: int
    i1: int
    j0: int
    j1: int
    peer: int
    block: int = 0

    @property
    def rect(self) -> Rect:
        """The cells ``(i0, i1, j0, j1)``."""
        return self.i0, self.i1, self.j0, self.j1


@dataclass(frozen=True)
class BlockPolicy:
    """How a home cuts a shard's atoms into blocks (module docstring).

    A block of less than ``index_factor`` times the shard's index size (or ``min_bytes``) takes
    the next atom even when no rank needs both, so that no reader pays an index for a sliver;
    a block stops growing at ``max_bytes`` of values.
    """

    max_bytes: int = 4 * 1024 * 1024
    min_bytes: int = 256 * 1024
    index_factor: int = 128


@dataclass
class HomePlan:
    """A home's plan for the shards it received demands for."""

    #: Per rank, the rows it gets from this home.
    rows: dict[int, list[Row]] = field(default_factory=dict)
    #: Bytes of the cells some rank needs (each cell once).
    union_bytes: int = 0
    #: Bytes of the cells summed over the ranks needing them (what own reads would fetch).
    demanded_bytes: int = 0
    #: Cells stored bytes the readers fetch (chunks with their checksums).
    read_bytes: int = 0
    #: The next block number (``home << 32`` plus the blocks planned).
    blocks: int = 0


def home_of(array: int, shard: int, world_size: int) -> int:
    """The home rank of the shard starting at cell row ``shard`` of array ``array``."""
    return zlib.crc32(f"{array}/{shard}".encode()) % world_size


#: A rank's needs of one array: flat ranges and boxes (of the array seen as a matrix of its
#: last dimension's columns: :class:`~ucformat.layout.cells.OutBox`), in any mix.
NeedItems = Sequence[tuple[int, int] | OutBox]


def rank_demands(
    rank: int,
    needs: Mapping[int, NeedItems],
    grids: Mapping[int, CellGrid],
    world_size: int,
) -> list[tuple[int, Demand]]:
    """A rank's needs (per stored array: flat ranges and boxes) as demands, each with its home
    rank."""
    out: list[tuple[int, Demand]] = []
    for array, items in needs.items():
        grid = grids[array]
        boxes = [item for item in items if isinstance(item, OutBox)]
        runs: list[tuple[int, int, int]] = []
        at = 0
        for item in items:
            if not isinstance(item, OutBox):  # consecutive in the output: column blocks merge
                runs.append((item[0], item[1], at))
                at += item[1] - item[0]
        if grid.box:
            rects = grid.need_rects([*boxes, *grid.out_boxes(runs)])
        else:
            rects = grid.need_rects([*runs, *_box_runs(boxes, grid.shape[-1] if grid.shape else 1)])
        for rect in rects:
            home = home_of(array, grid.shard_of(rect[0])[0], world_size)
            out.append((home, Demand(rank, array, rect)))
    return out


def _box_runs(boxes: Sequence[OutBox], cols: int) -> list[tuple[int, int, int]]:
    """Boxes of a flat-chunked array as its flat runs (whole rows as one run)."""
    runs: list[tuple[int, int, int]] = []
    for box in boxes:
        if box.x0 == 0 and box.x1 == cols:
            runs.append((box.y0 * cols, box.y1 * cols, 0))
        else:
            runs += [(y * cols + box.x0, y * cols + box.x1, 0) for y in range(box.y0, box.y1)]
    return runs


@dataclass
class _Atom:
    i0: int
    i1: int
    j0: int
    j1: int
    classes: tuple[int, ...]


def _atoms(classes: list[list[Rect]]) -> list[tuple[Rect, tuple[int, ...]]]:
    """The shard's needed cells as rects of cells needed by the same classes, row-major: a
    sweep down the rows (bands between the rects' row edges), in each band a sweep across the
    columns of the rects covering it, a band's segment stacked on the same one just above.
    Work grows with the rects, not the cells."""
    rects = sorted((*rect, number) for number, own in enumerate(classes) for rect in own)
    cuts = sorted({r[0] for r in rects} | {r[1] for r in rects})
    atoms: list[_Atom] = []
    above: dict[tuple[int, int, tuple[int, ...]], _Atom] = {}
    active: list[tuple[int, int, int, int, int]] = []
    taken = 0
    for low, high in itertools.pairwise(cuts):
        active = [r for r in active if r[1] > low]
        while taken < len(rects) and rects[taken][0] <= low:
            active.append(rects[taken])
            taken += 1
        edges = sorted({r[2] for r in active} | {r[3] for r in active})
        segments: list[tuple[int, int, tuple[int, ...]]] = []
        for left, right in itertools.pairwise(edges):
            who = tuple(sorted({r[4] for r in active if r[2] <= left and r[3] >= right}))
            if not who:
                continue
            if segments and segments[-1][1] == left and segments[-1][2] == who:
                segments[-1] = (segments[-1][0], right, who)
            else:
                segments.append((left, right, who))
        for left, right, who in segments:
            atom = above.get((left, right, who))
            if atom is not None and atom.i1 == low:
                atom.i1 = high
                continue
            atom = above[left, right, who] = _Atom(low, high, left, right, who)
            atoms.append(atom)
    return sorted(
        (((a.i0, a.i1, a.j0, a.j1), a.classes) for a in atoms), key=lambda x: (x[0][0], x[0][2])
    )


#: Per shard ``(array, first cell row)``: the ranks needing the same rects of it, by rects.
ShardNeeds = Mapping[tuple[int, int], Mapping[tuple[Rect, ...], Sequence[int]]]


def plan_home(
    demands: Iterable[Demand],
    grids: Mapping[int, CellGrid],
    policy: BlockPolicy | None = None,
    *,
    home: int = 0,
) -> HomePlan:
    """Plan every shard that ``demands`` (all the demands this home received) touch.

    Deterministic: the same demands, in any order, give the same plan. Block numbers are
    ``home << 32 | n``: unique across homes.
    """
    needs = shard_needs(((d.rank, d.array, d.rect) for d in demands), grids)
    return plan_shards(needs, grids, policy, home=home)


def shard_needs(
    demands: Iterable[tuple[int, int, Rect]], grids: Mapping[int, CellGrid]
) -> dict[tuple[int, int], dict[tuple[Rect, ...], list[int]]]:
    """Demands ``(rank, array, rect)`` as a home plans them: per shard, the ranks by the rects
    they need of it (:data:`ShardNeeds`)."""
    by_rank: dict[tuple[int, int], dict[int, list[Rect]]] = {}
    shards: dict[tuple[int, int], int] = {}  # (array, cell row) -> its shard's first row
    for rank, array, rect in demands:
        shard = shards.get((array, rect[0]))
        if shard is None:
            shard = shards[array, rect[0]] = grids[array].shard_of(rect[0])[0]
        by_rank.setdefault((array, shard), {}).setdefault(rank, []).append(rect)
    return {key: group_ranks(ranks) for key, ranks in by_rank.items()}


def group_ranks(ranks: Mapping[int, Iterable[Rect]]) -> dict[tuple[Rect, ...], list[int]]:
    """Ranks that need the same rects of a shard, as one class each (by their rects)."""
    grouped: dict[tuple[Rect, ...], list[int]] = {}
    for rank, rects in ranks.items():
        grouped.setdefault(tuple(sorted(set(rects))), []).append(rank)
    return grouped


def plan_shards(
    shards: ShardNeeds,
    grids: Mapping[int, CellGrid],
    policy: BlockPolicy | None = None,
    *,
    home: int = 0,
) -> HomePlan:
    """:func:`plan_home` of needs already grouped by shard and class (what a home builds
    from the demands it receives; a simulation builds it without :class:`Demand` objects)."""
    policy = policy or BlockPolicy()
    plan = HomePlan()
    plan.blocks = home << 32
    load: dict[int, int] = {}
    for array, shard_lo in sorted(shards):
        grid = grids[array]
        _plan_shard(
            plan, load, grid, array, grid.shard_of(shard_lo), shards[array, shard_lo], policy
        )
    return plan


def _plan_shard(
    plan: HomePlan,
    load: dict[int, int],
    grid: CellGrid,
    array: int,
    shard: tuple[int, int],
    grouped: Mapping[tuple[Rect, ...], Sequence[int]],
    policy: BlockPolicy,
) -> None:
    keys = sorted(grouped, key=lambda k: min(grouped[k]))
    classes = [list(key) for key in keys]
    members = [sorted(grouped[key]) for key in keys]
    atoms = _atoms(classes)
    for rect, who in atoms:
        size = grid.nbytes(rect)
        plan.union_bytes += size
        plan.demanded_bytes += size * sum(len(members[c]) for c in who)
    floor = max(policy.min_bytes, policy.index_factor * grid.shard_index_bytes())
    blocks: list[list[tuple[Rect, tuple[int, ...]]]] = []
    common: set[int] = set()
    size = 0
    for rect, who in atoms:
        nbytes = grid.nbytes(rect)
        joins = blocks and size + nbytes <= max(policy.max_bytes, floor)
        if joins and not (common & set(who)) and size >= floor:
            joins = False
        if joins:
            blocks[-1].append((rect, who))
            common = (common & set(who)) or set(who)
            size += nbytes
        else:
            blocks.append([(rect, who)])
            common, size = set(who), nbytes
    for block in blocks:
        need: dict[int, int] = {}
        for rect, who in block:
            cells = (rect[1] - rect[0]) * (rect[3] - rect[2])
            for number in who:
                need[number] = need.get(number, 0) + cells
        reader = _reader(f"{array}/{shard[0]}/{plan.blocks}", need, members, load)
        tag = plan.blocks
        plan.blocks += 1
        mine = plan.rows.setdefault(reader, [])
        for rect, who in block:
            nbytes = grid.nbytes(rect)
            load[reader] = load.get(reader, 0) + nbytes
            plan.read_bytes += grid.stored_bytes((rect[1] - rect[0]) * (rect[3] - rect[2]))
            mine.append(Row(READ, array, *rect, reader, tag))
            receive = Row(RECV, array, *rect, reader)
            i0, i1, j0, j1 = rect
            for number in who:
                for rank in members[number]:  # (a Row made as a tuple: many per hot shard)
                    mine.append(_new(Row, (SEND, array, i0, i1, j0, j1, rank, tag)))
                    if rank != reader:
                        plan.rows.setdefault(rank, []).append(receive)


def _reader(
    salt: str, need: Mapping[int, int], members: Sequence[Sequence[int]], load: Mapping[int, int]
) -> int:
    """The block's reader: among the ranks needing at least half as many of its cells as the
    rank needing most (so that a partition's boundary chunk goes with the partition), the one
    this home has given the fewest bytes, ties broken by a hash of the block and the rank (so
    that ranks in the same position of every parameter do not all win)."""
    most = max(need.values())
    return min(
        (load.get(rank, 0), zlib.crc32(f"{salt}/{rank}".encode()), rank)
        for number, count in need.items()
        if 2 * count >= most
        for rank in members[number]
    )[2]


# --- rounds ---------------------------------------------------------------------------------
def pair_cap(budget: int, fan_out: int, fan_in: int) -> int:
    """Bytes rank ``q`` sends rank ``r`` per round: half the budget shared by the larger of
    ``q``'s receivers and ``r``'s senders (both ends compute the same)."""
    return max(1, budget // (2 * max(1, fan_out, fan_in)))


@dataclass(frozen=True)
class Piece:
    """Cells ``rect`` of ``array`` moved in round ``round`` (a slice of an atom: ``atom`` is
    the whole rect its reader staged, ``rect`` whole cell rows of it)."""

    round: int
    array: int
    atom: Rect
    rect: Rect
    nbytes: int


def schedule(
    rows: Sequence[tuple[int, Rect]], grids: Mapping[int, CellGrid], cap: int
) -> list[Piece]:
    """The pieces of one pair's atoms ``(array, rect)`` in rounds of at most ``cap`` bytes
    (at least one cell row per round): the same on both ends, given the same atoms."""
    pieces: list[Piece] = []
    current, used = 0, 0
    for array, atom in sorted(rows):
        grid = grids[array]
        for rect in grid.sub_rects(atom, cap):
            nbytes = grid.nbytes(rect)
            if used and used + nbytes > cap:
                current, used = current + 1, 0
            pieces.append(Piece(current, array, atom, rect, nbytes))
            used += nbytes
    return pieces


def reads_cost(rows: Iterable[Row], grids: Mapping[int, CellGrid]) -> ReadCost:
    """What a reader fetches for its ``READ`` rows (:mod:`ucformat.layout.reads`): each block
    in one read (its atoms' runs, adjacent ones joined), each shard's index once."""
    blocks: dict[int, list[Row]] = {}
    for row in rows:
        if row.kind == READ:
            blocks.setdefault(row.block, []).append(row)
    total = ReadCost(0, 0, 0, 0)
    shards: set[tuple[int, int]] = set()
    index_bytes = 0
    for block in blocks.values():
        grid = grids[block[0].array]
        shards.update((row.array, grid.shard_of(row.rect[0])[0]) for row in block)
        if grid.box:  # one read of the block's chunks, found from its cells directly
            rects = [part for row in block for part in grid.chunk_rects(row.rect)]
            cost = chunk_rects_read_cost(grid.shape, grid.chunk_shape, grid.shard_shape,
                                         grid.itemsize, [rects])  # fmt: skip
        else:
            runs = [(a, b) for a, b, _ in grid.block_runs([row.rect for row in block])]
            cost = range_read_cost(grid.shape, grid.chunk_shape, grid.shard_shape, grid.itemsize,
                                   runs)  # fmt: skip
        total += ReadCost(cost.data_bytes, 0, cost.chunks, 0, cost.data_requests, 0)
    for array, _ in shards:
        index_bytes += grids[array].shard_index_bytes()
    indexed = sum(1 for array, _ in shards if grids[array].shape)
    return total + ReadCost(0, index_bytes, 0, len(shards), 0, indexed)
