"""Read each chunk once, job-wide, then share: the collective executor of a :class:`ReadBatch`.

Every rank of a collective load calls :func:`plan_shared` with what it needs, then (unless the
plan says ``own``) :func:`execute_shared` with its batch of buffers. In between, nothing but
integers: the plan is :mod:`ucformat.layout.read_once`'s (homes, blocks, readers, rounds).

1. **needs to homes**: the rank's needs become cell rects per shard
   (:meth:`~ucformat.layout.cells.CellGrid.need_rects`), each sent to its shard's home (one
   all-to-all of int64 rows, :func:`ucformat.collective.exchange_blobs`);
2. **homes plan** the shards they received (:func:`~ucformat.layout.read_once.plan_home`) and
   send each rank its rows (``READ`` / ``SEND`` / ``RECV``, one more all-to-all);
3. **one gathering** of four numbers per rank (its senders and receivers, and its homes'
   bytes needed once and demanded) fixes the per-pair round sizes, and decides ``auto``: read
   once when the ranks' own reads would fetch more than :data:`AUTO_THRESHOLD` over the bytes
   needed once (replicas, chunks cut by partitions), else ``own``;
4. **rounds** (:func:`execute_shared`): a reader reads each of its blocks once
   (:meth:`~ucformat.read.checkpoint.UniversalCheckpoint.fill`: checksums checked, counted in
   the store's :class:`~ucformat.store.checked.IOStats`), places its own part straight into
   its buffers and sends the rest; every round is one all-to-all of exactly the bytes both
   ends planned (:func:`ucformat.collective.exchange_bytes`), received cells go straight into
   the buffers. A round holds at most ``budget`` bytes in flight per rank, plus the blocks a
   reader is still sending from.

A rank that fails to read a block keeps taking part in every round (sending zeros), so no rank
is left waiting; its failure is returned, and the caller's agreement
(:func:`ucformat.collective.settle`) makes every rank raise it.

Transport: the ranks talk through a :class:`Transport` (:class:`GroupTransport`: ucformat's
private gloo group; the bytes are in host memory. On GPUs the same rounds could go over NCCL
into device buffers: docs/design.md, "Collectives and threads").
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ucformat.collective import Group, exchange_blobs, exchange_bytes, gather_ints
from ucformat.errors import CoverageError, UCFormatError
from ucformat.format.dtypes import numpy_storage_dtype
from ucformat.format.models import ArrayRef, CheckpointManifest
from ucformat.format.stacks import StoredArray, stored_array
from ucformat.layout.cells import CellGrid, Rect
from ucformat.layout.read_once import (
    READ,
    RECV,
    SEND,
    BlockPolicy,
    Piece,
    Row,
    pair_cap,
    plan_shards,
    rank_demands,
    schedule,
    shard_needs,
)
from ucformat.read.batch import Placement, ReadBatch, grid_of
from ucformat.read.checkpoint import UniversalCheckpoint
from ucformat.sysio.collector import collection_paused

__all__ = [
    "AUTO_THRESHOLD",
    "DEFAULT_BUDGET",
    "MODES",
    "GroupTransport",
    "SharedPlan",
    "SharedStats",
    "Transport",
    "execute_shared",
    "plan_shared",
]

#: ``read=`` values of the loaders: ``auto`` (once where it saves reads), ``once``, ``own``.
MODES = ("auto", "once", "own")
#: ``auto`` reads once when own reads would fetch more than this fraction over the bytes
#: needed once.
AUTO_THRESHOLD = 0.01
#: Bytes a rank has in flight per round (half sent, half received).
DEFAULT_BUDGET = 64 * 1024 * 1024


class Transport(Protocol):
    """How the ranks of a read-once load talk (:class:`GroupTransport` in a real job)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def blobs(self, out: list[np.ndarray]) -> list[np.ndarray]:
        """All-to-all of byte strings of any size (``out[d]`` to rank ``d``)."""
        ...

    def sized(self, out: list[np.ndarray], receive: list[int]) -> list[np.ndarray]:
        """All-to-all of byte strings whose sizes both ends know (``receive[s]`` from ``s``)."""
        ...

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values``, in rank order."""
        ...


@dataclass(frozen=True)
class GroupTransport:
    """A :class:`Transport` over a :class:`ucformat.collective.Group` (its private gloo
    group)."""

    group: Group

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def blobs(self, out: list[np.ndarray]) -> list[np.ndarray]:
        return exchange_blobs(out, self.group)

    def sized(self, out: list[np.ndarray], receive: list[int]) -> list[np.ndarray]:
        flat = [part.reshape(-1).view(np.uint8) for part in out]
        payload = torch.from_numpy(np.concatenate(flat) if flat else np.empty(0, np.uint8))
        sizes = [int(part.nbytes) for part in out]
        parts = exchange_bytes(payload, sizes, receive, self.group)
        return [part.numpy() for part in parts]

    def gather(self, values: list[int]) -> list[list[int]]:
        return gather_ints(values, self.group)


@dataclass
class SharedStats:
    """What a read-once load moved (per rank) and what the job's homes planned (job-wide)."""

    mode: str = "own"
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    #: Job-wide: bytes of cells some rank needs (each once), and summed over the ranks.
    union_bytes: int = 0
    demanded_bytes: int = 0


@dataclass
class SharedPlan:
    """This rank's part of a read-once load (data only: no buffers, no files)."""

    paths: list[str]
    refs: dict[int, StoredArray]
    grids: dict[int, CellGrid]
    rows: list[Row]
    outgoing: dict[int, list[Piece]] = field(default_factory=dict)
    incoming: dict[int, list[Piece]] = field(default_factory=dict)
    rounds: int = 0
    stats: SharedStats = field(default_factory=SharedStats)


def stored_arrays(manifest: CheckpointManifest) -> dict[str, StoredArray]:
    """Every stored array of the store by path (the ids of the plan's rows: positions in
    sorted order): a format-3.1 store's stacks, an older store's arrays."""
    found: dict[str, ArrayRef] = {}
    for ref in _refs(manifest):
        found.setdefault(ref.path, ref)
    return {path: stored_array(found[path]) for path in sorted(found)}


def _refs(manifest: CheckpointManifest) -> Iterator[ArrayRef]:
    """Every logical array's ref, as :meth:`CheckpointManifest.arrays` lists them but without
    their names (building 136k names takes a DeepSeek-V3 store's ranks a second)."""
    for entry in manifest.params.values():
        yield from entry.states.values()
        yield from entry.whole_states.values()
    for buffer in manifest.buffers.values():
        yield buffer.array
    for group in manifest.optimizer.groups if manifest.optimizer is not None else []:
        yield from (state.array for state in group.partition_states.values())


_DEMAND_WIDTH, _ROW_WIDTH = 5, 8


def _encode(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, len(rows) * width)
    return flat.view(np.uint8)


def _decode(blob: np.ndarray, width: int) -> np.ndarray:
    return np.frombuffer(blob.tobytes(), dtype=np.int64).reshape(-1, width)


def plan_shared(
    ckpt: UniversalCheckpoint,
    needs: Mapping[str, Sequence[tuple[int, int]]],
    transport: Transport,
    *,
    mode: str = "auto",
    budget: int = DEFAULT_BUDGET,
    policy: BlockPolicy | None = None,
) -> SharedPlan:
    """Plan a read-once load (collective: every rank calls it, with its own ``needs``: per
    stored array path, the flat ranges it reads of it: :meth:`~ucformat.read.batch.ReadBatch.
    needs`). ``plan.stats.mode`` says how to read: ``once``
    (then :func:`execute_shared`) or ``own`` (each rank reads its own batch)."""
    with collection_paused():  # a hot home makes a tuple per (rank, cell): no cycles
        return _plan_shared(ckpt, needs, transport, mode, budget, policy)


def _plan_shared(
    ckpt: UniversalCheckpoint,
    needs: Mapping[str, Sequence[tuple[int, int]]],
    transport: Transport,
    mode: str,
    budget: int,
    policy: BlockPolicy | None,
) -> SharedPlan:
    world, me = transport.world_size, transport.rank
    table = stored_arrays(ckpt.manifest)
    paths = list(table)
    ids = {path: number for number, path in enumerate(paths)}
    grids: dict[int, CellGrid] = {}
    refs: dict[int, StoredArray] = {}

    def grid(number: int) -> CellGrid:
        found = grids.get(number)
        if found is None:
            refs[number] = table[paths[number]]
            found = grids[number] = grid_of(refs[number])
        return found

    numbered = {ids[path]: ranges for path, ranges in needs.items()}
    for number in list(numbered):
        if not grid(number).plannable:  # read by the rank itself (execute_shared)
            del numbered[number]
    outboxes: list[list[tuple[int, ...]]] = [[] for _ in range(world)]
    for home_rank, demand in rank_demands(me, numbered, grids, world):
        outboxes[home_rank].append((demand.array, *demand.rect))
    received = transport.blobs([_encode(rows, _DEMAND_WIDTH) for rows in outboxes])
    demands = [
        (sender, array, (i0, i1, j0, j1))
        for sender, blob in enumerate(received)
        for array, i0, i1, j0, j1 in _decode(blob, _DEMAND_WIDTH).tolist()
    ]
    for array in {array for _, array, _ in demands}:
        grid(array)
    home = plan_shards(shard_needs(demands, grids), grids, policy, home=me)  # this rank's shards
    del demands
    replies = transport.blobs([_encode(home.rows.get(d, []), _ROW_WIDTH) for d in range(world)])
    rows = [Row(*r) for blob in replies for r in _decode(blob, _ROW_WIDTH).tolist()]
    for array in {row.array for row in rows}:
        grid(array)
    receivers = {r.peer for r in rows if r.kind == SEND and r.peer != me}
    senders = {r.peer for r in rows if r.kind == RECV}
    everyone = transport.gather([len(receivers), len(senders), home.union_bytes,
                                 home.demanded_bytes])  # fmt: skip
    union = sum(v[2] for v in everyone)
    demanded = sum(v[3] for v in everyone)
    saves = demanded - union > AUTO_THRESHOLD * union
    chosen = "once" if mode == "once" or (mode == "auto" and saves) else "own"
    plan = SharedPlan(paths, refs, grids, rows, stats=SharedStats(chosen, 0, 0, 0, union, demanded))
    if chosen == "own":
        return plan
    out_rows: dict[int, list[tuple[int, Rect]]] = {}
    in_rows: dict[int, list[tuple[int, Rect]]] = {}
    for row in rows:
        if row.kind == SEND and row.peer != me:
            out_rows.setdefault(row.peer, []).append((row.array, row.rect))
        elif row.kind == RECV:
            in_rows.setdefault(row.peer, []).append((row.array, row.rect))
    for peer, atoms in out_rows.items():
        plan.outgoing[peer] = schedule(atoms, grids, pair_cap(budget, everyone[me][0],
                                                               everyone[peer][1]))  # fmt: skip
    for peer, atoms in in_rows.items():
        plan.incoming[peer] = schedule(atoms, grids, pair_cap(budget, everyone[peer][0],
                                                              everyone[me][1]))  # fmt: skip
    last = [p.round for pieces in (*plan.outgoing.values(), *plan.incoming.values())
            for p in pieces]  # fmt: skip
    plan.rounds = max(v[0] for v in transport.gather([max(last, default=-1) + 1]))
    plan.stats.rounds = plan.rounds
    return plan


def execute_shared(
    ckpt: UniversalCheckpoint, plan: SharedPlan, batch: ReadBatch, transport: Transport
) -> BaseException | None:
    """Carry out ``plan`` (collective): fill every item of ``batch``. Returns this rank's
    failure (a block it could not read), or None; every rank takes part in every round
    either way."""
    me = transport.rank
    placement = Placement(batch)
    blocks: dict[int, list[Row]] = {}
    for row in plan.rows:
        if row.kind == READ:
            blocks.setdefault(row.block, []).append(row)
    block_of = {(r.array, r.rect): r.block for r in plan.rows if r.kind == READ}
    self_sends = {(r.array, r.rect) for r in plan.rows if r.kind == SEND and r.peer == me}
    last_use: dict[int, int] = {}
    for pieces in plan.outgoing.values():
        for piece in pieces:
            tag = block_of[piece.array, piece.atom]
            last_use[tag] = max(last_use.get(tag, -1), piece.round)
    staged: dict[tuple[int, Rect], np.ndarray] = {}
    failure: BaseException | None = None
    try:  # items of grids the plan does not describe: this rank reads them itself
        for item in batch.items:
            if not grid_of(item.stored).plannable:
                ckpt.fill(item.ref, item.runs, item.out)
    except (UCFormatError, OSError) as exc:
        failure = exc

    def read_block(tag: int) -> None:
        nonlocal failure
        rows = blocks[tag]
        ref = plan.refs[rows[0].array]
        grid = plan.grids[rows[0].array]
        sizes = [grid.elements(row.rect) for row in rows]
        values = np.empty(sum(sizes), dtype=numpy_storage_dtype(ref.dtype))
        runs = grid.block_runs([row.rect for row in rows])
        if failure is None:
            try:
                ckpt.fill_stored(ref, runs, values)
            except (UCFormatError, OSError) as exc:
                failure = exc
        at = 0
        for row, size in zip(rows, sizes, strict=True):
            part = values[at : at + size]
            at += size
            staged[row.array, row.rect] = part
            if (row.array, row.rect) in self_sends and failure is None:
                placement.place(plan.paths[row.array], row.rect, part)

    for tag in sorted(blocks):
        if tag not in last_use:  # read for this rank alone: read, place, drop
            read_block(tag)
            for row in blocks[tag]:
                staged.pop((row.array, row.rect), None)
    world = transport.world_size
    for round_ in range(plan.rounds):
        out: list[np.ndarray] = [np.empty(0, np.uint8) for _ in range(world)]
        for peer, pieces in plan.outgoing.items():
            parts = []
            for piece in pieces:
                if piece.round != round_:
                    continue
                key = (piece.array, piece.atom)
                if key not in staged:
                    read_block(block_of[key])
                grid = plan.grids[piece.array]
                start = grid.offset_in(piece.atom, piece.rect)
                parts.append(staged[key][start : start + grid.elements(piece.rect)].view(np.uint8))
            if parts:
                out[peer] = np.concatenate(parts)
        receive = [0] * world
        for peer, pieces in plan.incoming.items():
            receive[peer] = sum(p.nbytes for p in pieces if p.round == round_)
        got = transport.sized(out, receive)
        plan.stats.bytes_sent += sum(int(part.nbytes) for part in out)
        plan.stats.bytes_received += sum(receive)
        for peer, pieces in plan.incoming.items():
            at = 0
            for piece in pieces:
                if piece.round != round_:
                    continue
                dtype = numpy_storage_dtype(plan.refs[piece.array].dtype)
                values = got[peer][at : at + piece.nbytes].view(dtype)
                at += piece.nbytes
                if failure is None:
                    placement.place(plan.paths[piece.array], piece.rect, values)
        for tag, last in last_use.items():
            if last == round_:
                for row in blocks[tag]:
                    staged.pop((row.array, row.rect), None)
    if failure is None and (missing := placement.missing()):
        failure = CoverageError(
            "a read-once load did not deliver every element this rank needs ("
            + "; ".join(missing[:3])
            + "); this is a bug in ucformat's read plan, please report it."
        )
    return failure
