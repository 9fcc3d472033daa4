"""Execute one :class:`~ucformat.write.plan.ConvertPlan` on many processes: one writer per shard.

Every rank holds the same plan (each rank computes it; :func:`write_spread` checks that they
agree). A fragment's tensor is either readable by any rank (a file: distributed convert), or
held in the memory of one rank (:class:`~ucformat.sources.live.MemoryTensor` on that rank,
:class:`~ucformat.sources.live.RemoteTensor` naming it on the others: a live save). Each unit
has exactly one writer, chosen by :mod:`ucformat.layout.ownership`. The steps, each closed by an
agreement (:func:`ucformat.collective.agree`):

1. the ranks compare their plans' fingerprints;
2. rank 0 empties the destination and writes the root group;
3. every rank writes the units it holds entirely with the converter's own writer
   (:func:`ucformat.write.execute.write_units`, thread pool, streamed shard encoder) on a
   background thread, and its share of the arrays' ``zarr.json`` on another one (nothing
   reads them before the commit; written by rank 0 first, their many small file creations
   held every rank up), while units whose writer lacks some of their bytes go in rounds of at
   most half of ``exchange_budget`` bytes: one all-to-all per round moves exactly the missing
   runs from the ranks that hold them to the writer, which writes those shards in the
   background too while the next round is exchanged (at most one round waits to be written);
4. every rank fsyncs what it wrote (a local store) and agrees;
5. rank 0 commits the manifest (:func:`ucformat.store.manifest_io.commit_manifest`), whose
   digest it computed beside the shard writes (the ranks all wait for the commit).

A failure anywhere makes every rank raise the same
:class:`~ucformat.errors.CollectiveError`; nothing is committed, and a local store that the
write created is removed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ucformat.collective import Group, exchange_bytes, fingerprint, settle
from ucformat.errors import StoreExistsError
from ucformat.format.dtypes import itemsize
from ucformat.format.models import CheckpointManifest
from ucformat.layout.ownership import exchange_rounds
from ucformat.sources.live import MemoryTensor
from ucformat.store.arrays import array_from_manifest, metadata_documents, write_objects
from ucformat.store.direct.objects import make_folders
from ucformat.store.lifecycle import discard_store, start_store
from ucformat.store.manifest_io import ROOT_KEY, commit_manifest, manifest_digest
from ucformat.write.execute import DEFAULT_WORKERS, write_units
from ucformat.write.plan import ConvertPlan, CopyItem, WriteUnit

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ucformat.store.keys import Store

__all__ = [
    "DEFAULT_EXCHANGE_BUDGET",
    "SpreadReport",
    "holdings",
    "write_spread",
]

_T = TypeVar("_T")

#: What a rank may hold in received and to-be-sent bytes at a time, beyond its own tensors:
#: rounds move at most half of it (all ranks together), one round being exchanged while the
#: previous one is written.
DEFAULT_EXCHANGE_BUDGET = 64 * 1024 * 1024


def _rank_of(copy: CopyItem) -> int | None:
    """The rank holding a copy's bytes, or None if any rank can read them (a file)."""
    rank = getattr(copy.fragment.tensor, "rank", None)
    return rank if isinstance(rank, int) else None


def holdings(plan: ConvertPlan) -> list[dict[int, int]]:
    """Per unit, rank -> elements of it held in that rank's memory (for the writer choice)."""
    result: list[dict[int, int]] = []
    for unit in plan.units:
        held: dict[int, int] = {}
        for copy in unit.copies:
            rank = _rank_of(copy)
            if rank is not None:
                held[rank] = held.get(rank, 0) + copy.length
        result.append(held)
    return result


def plan_fingerprint(plan: ConvertPlan) -> str:
    """A digest of the plan's structure (arrays, units, copies and who holds them) and of
    every parameter's scalars (the ranks must be at the same point). A plan made by
    :func:`~ucformat.write.plan.plan_convert` is a function of its layout key, whose digest
    stands for the structure; a plan built otherwise is digested unit by unit."""
    scalars = [
        [name, [[key, s.kind, s.value, s.dtype] for key, s in entry.scalars.items()]]
        for name, entry in plan.manifest.params.items()
    ]
    if plan.layout is not None:
        return fingerprint([plan.layout.digest, scalars])
    return fingerprint(
        [
            [dataclasses.astuple(array) for array in plan.arrays],
            [
                [u.array, u.flat_start, u.flat_stop]
                + [[_rank_of(c), c.tensor_start, c.offset, c.length] for c in u.copies]
                for u in plan.units
            ],
            scalars,
        ]
    )


@dataclass
class SpreadReport:
    """What :func:`write_spread` did on this rank."""

    units_written: int = 0
    bytes_written: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    exchange_rounds: int = 0
    committed: bool = False
    seconds: float = 0.0
    #: The committed manifest (rank 0), or this rank's plan manifest.
    manifest: CheckpointManifest | None = None


@dataclass(frozen=True)
class _Remote:
    """One run of a unit that its writer receives from the rank holding it."""

    unit: int
    copy: int
    source: int
    writer: int
    nbytes: int


def _remote_runs(plan: ConvertPlan, writers: Sequence[int]) -> list[list[_Remote]]:
    """Per unit, the runs its writer lacks (same on every rank: plan order, copy order)."""
    runs: list[list[_Remote]] = []
    for index, unit in enumerate(plan.units):
        item = itemsize(plan.arrays[unit.array].dtype)
        mine: list[_Remote] = []
        for position, copy in enumerate(unit.copies):
            rank = _rank_of(copy)
            if rank is not None and rank != writers[index]:
                mine.append(_Remote(index, position, rank, writers[index], copy.length * item))
        runs.append(mine)
    return runs


def write_spread(
    plan: ConvertPlan,
    store: Store,
    *,
    writers: Sequence[int],
    group: Group,
    where: str,
    overwrite: bool = False,
    workers: int = DEFAULT_WORKERS,
    exchange_budget: int = DEFAULT_EXCHANGE_BUDGET,
    progress: Callable[[int], None] | None = None,
    before_commit: Callable[[], object] | None = None,
    overwrite_hint: str = "",
    fsync: bool = True,
) -> SpreadReport:
    """Write ``plan`` into ``store`` from every rank of ``group``; rank 0 commits.

    Call on every rank with the same plan structure and ``writers`` (one rank per unit).
    ``before_commit`` runs on every rank after its writes (e.g. the source CRC check); its
    error fails every rank before anything is committed. ``overwrite_hint`` replaces the
    CLI's ``--overwrite`` in the message of an existing store (``overwrite=True`` for the API).
    ``fsync=False`` skips making a local store durable (docs/format.md §6): the store is
    complete for readers once committed, but a power loss may lose what the page cache held.

    Raises:
        CollectiveError: some rank failed (the same error on every rank); nothing was
            committed.
    """
    started = time.perf_counter()
    report = SpreadReport(manifest=plan.manifest)
    rank = group.rank
    settle(None, group, where, extra=plan_fingerprint(plan))

    failure: BaseException | None = None
    created = False
    documents: dict[str, bytes] = {}
    shard_keys: list[str] = []  # of the shards this rank writes (fsynced before the commit)
    try:
        documents = metadata_documents(plan.arrays)  # every array's and group's zarr.json
        keys = _shard_keys(plan, plan.units)
        shard_keys = [key for key, writer in zip(keys, writers, strict=True) if writer == rank]
        if rank == 0:
            created = _start(store, plan, overwrite, overwrite_hint)
            # Every object's folder, made once by one process before any rank writes a byte
            # (the others wait at the agreement below anyway; folders made by every rank at
            # once contend for the same parents: docs/benchmarks.md).
            make_folders(store, [*keys, *documents])
    except Exception as exc:  # every rank must learn of it, whatever it is
        failure = exc
    settle(failure, group, where, cleanup=lambda: _discard(rank, store, created))

    share: dict[str, bytes] = {}
    try:  # the arrays whose metadata the ranks write meanwhile, opened without reading it
        arrays = [array_from_manifest(store, ref) for ref in plan.arrays]
        runs = _remote_runs(plan, writers)
        share = _metadata_share(documents, group)
    except Exception as exc:
        failure, arrays, runs = exc, [], [[] for _ in plan.units]
    exchanged = [index for index, unit_runs in enumerate(runs) if unit_runs]
    needs = [sum(run.nbytes for run in runs[index]) for index in exchanged]
    mine = [u for i, u in enumerate(plan.units) if writers[i] == rank and not runs[i]]
    writes = _BackgroundWrites(plan, arrays, workers, report, writeback=fsync)
    digest: Future[str] | None = None
    try:
        if failure is None:  # this rank's share of the metadata, beside the shards
            writes.beside(lambda: write_objects(store, share))
        if failure is None and rank == 0:  # the manifest's digest, off the commit's path
            digest = writes.beside(lambda: manifest_digest(plan.manifest))
        if failure is None:  # this rank's own units, written while the rounds exchange
            writes.submit(mine, progress)
        # Half the budget per round: one round is exchanged while the previous one is written.
        for round_ in exchange_rounds(needs, max(1, exchange_budget // 2)):
            failure = _first(failure, writes.wait(keep=1))
            failure, rebuilt = _exchange_round(
                plan, [exchanged[i] for i in round_], runs, writers, group, report, failure
            )
            if failure is None and rebuilt:
                writes.submit(rebuilt)
        failure = _first(failure, writes.wait(keep=0))
    finally:
        writes.close()
    if failure is None:
        try:
            if fsync:
                _flush(store, [*shard_keys, *share], group)
            if before_commit is not None:
                before_commit()
        except Exception as exc:
            failure = exc
    settle(failure, group, where, cleanup=lambda: _discard(rank, store, created))

    if rank == 0:
        try:
            report.manifest = commit_manifest(
                store, plan.manifest, durable=fsync, objects_synced=True,
                digest=None if digest is None else digest.result(),
            )  # fmt: skip
            report.committed = True
        except Exception as exc:
            failure = exc
    settle(failure, group, where)
    report.seconds = time.perf_counter() - started
    return report


def _start(store: Store, plan: ConvertPlan, overwrite: bool, hint: str) -> bool:
    """Rank 0's :func:`start_store` (True if it created the store); ``hint`` replaces the CLI's
    ``--overwrite`` in the message of an existing store."""
    try:
        return start_store(store, overwrite, plan.manifest.format_version)
    except StoreExistsError as exc:
        if not hint:
            raise
        raise StoreExistsError(str(exc).replace("--overwrite", hint)) from None


def _flush(store: Store, keys: list[str], group: Group) -> None:
    """Make what this rank wrote durable (a local store), every rank at once, before agreeing.

    Each rank fsyncs the objects ``keys`` it wrote (its shards and its
    :func:`_metadata_share`) and every directory above them; rank 0 also the root group's
    ``zarr.json``. The commit then fsyncs only the manifest and the root
    (``commit_manifest(objects_synced=True)``; docs/format.md §6, "Durability").
    """
    from ucformat.store.direct.objects import local_file
    from ucformat.store.durable import sync_written

    root = local_file(store, ROOT_KEY)
    if root is None:
        return
    if group.rank == 0:
        keys = [*keys, ROOT_KEY]
    sync_written(root.parent, dict.fromkeys(keys))


def _shard_keys(plan: ConvertPlan, units: Sequence[WriteUnit]) -> list[str]:
    """The store keys of the shard objects ``units`` write."""
    from ucformat.write.shard_encode import shard_of

    keys = []
    for unit in units:
        ref = plan.arrays[unit.array]
        keys.append(ref.shard_key(shard_of(ref, unit) if ref.shape else ()))
    return keys


def _metadata_share(documents: dict[str, bytes], group: Group) -> dict[str, bytes]:
    """The metadata objects (of ``documents``: every array's and group's ``zarr.json``, in plan
    order) this rank writes: every ``world_size``-th of them."""
    return dict(list(documents.items())[group.rank :: group.world_size])


def _discard(rank: int, store: Store, created: bool) -> None:
    if rank == 0:
        discard_store(store, created)


def _unit_bytes(plan: ConvertPlan, unit: WriteUnit) -> int:
    return unit.numel * itemsize(plan.arrays[unit.array].dtype)


def _exchange_round(
    plan: ConvertPlan,
    units: list[int],
    runs: list[list[_Remote]],
    writers: Sequence[int],
    group: Group,
    report: SpreadReport,
    failure: BaseException | None,
) -> tuple[BaseException | None, list[WriteUnit]]:
    """Move the missing runs of ``units`` to their writers; the units this rank now writes.

    Every rank takes part in the exchange even after a failure (sending zeros where its own
    bytes cannot be read), so that no rank waits forever; a failed rank writes nothing more.
    The returned units read their received runs from this round's receive buffer.
    """
    import torch

    rank, world = group.rank, group.world_size
    outgoing: list[list[np.ndarray]] = [[] for _ in range(world)]
    incoming = [0] * world
    for index in units:
        for run in runs[index]:
            if run.source == rank:
                copy = plan.units[index].copies[run.copy]
                tensor = copy.fragment.tensor
                if failure is None and isinstance(tensor, MemoryTensor):
                    outgoing[run.writer].append(tensor.segment(copy.tensor_start, copy.length))
                else:
                    if failure is None:
                        failure = RuntimeError(f"rank {rank} does not hold the bytes it must send")
                    outgoing[run.writer].append(np.zeros(run.nbytes, dtype=np.uint8))
            if run.writer == rank:
                incoming[run.source] += run.nbytes
    sizes = [sum(part.size for part in parts) for parts in outgoing]
    payload = np.empty(sum(sizes), dtype=np.uint8)  # one copy of the runs, in rank order
    at = 0
    for parts in outgoing:
        for part in parts:
            payload[at : at + part.size] = part
            at += part.size
    received = exchange_bytes(torch.from_numpy(payload), sizes, incoming, group)
    report.exchange_rounds += 1
    report.bytes_sent += sum(size for d, size in enumerate(sizes) if d != rank)
    report.bytes_received += sum(incoming)
    if failure is not None:
        return failure, []
    cursor = [0] * world
    rebuilt: list[WriteUnit] = []
    try:
        for index in units:
            if writers[index] != rank:
                continue
            unit = plan.units[index]
            copies = list(unit.copies)
            for run in runs[index]:
                copy = copies[run.copy]
                data = received[run.source][cursor[run.source] : cursor[run.source] + run.nbytes]
                cursor[run.source] += run.nbytes
                held = MemoryTensor(data.numpy(), copy.fragment.tensor.dtype_name, rank)
                copies[run.copy] = replace(
                    copy, fragment=replace(copy.fragment, tensor=held), tensor_start=0
                )
            rebuilt.append(replace(unit, copies=tuple(copies)))
    except Exception as exc:
        return exc, []
    return None, rebuilt


def _first(failure: BaseException | None, later: BaseException | None) -> BaseException | None:
    return failure if failure is not None else later


class _BackgroundWrites:
    """Batches of units written in order on one background thread (each batch with the
    converter's writer and its thread pool), so that the main thread exchanges the next round
    meanwhile; :meth:`wait` bounds how many batches, hence received buffers, are held."""

    def __init__(
        self, plan: ConvertPlan, arrays: list[Any], workers: int, report: SpreadReport,
        *, writeback: bool = False,
    ) -> None:  # fmt: skip
        from concurrent.futures import ThreadPoolExecutor

        self._plan, self._arrays, self._workers, self._report = plan, arrays, workers, report
        self._writeback = writeback
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucformat-spread")
        self._pending: list[tuple[Future[None], list[WriteUnit]]] = []
        self._beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucformat-meta")
        self._beside_jobs: list[Future[Any]] = []

    def beside(self, job: Callable[[], _T]) -> Future[_T]:
        """Run ``job`` on a thread of its own, beside the batches (the array metadata: many
        small objects, whose file-system latency then overlaps the shard writes); its future
        (:meth:`wait` with ``keep=0`` waits for it and reports its failure)."""
        future = self._beside.submit(job)
        self._beside_jobs.append(future)
        return future

    def submit(self, units: list[WriteUnit], progress: Callable[[int], None] | None = None) -> None:
        """Write ``units`` after the batches submitted before (an empty batch too: it is
        where a rank's writer is first called, as before the rounds ran in the background)."""
        future = self._pool.submit(
            write_units, self._plan, self._arrays, units, workers=self._workers,
            progress=progress, writeback=self._writeback,
        )  # fmt: skip
        self._pending.append((future, units))

    def wait(self, *, keep: int) -> BaseException | None:
        """Wait until at most ``keep`` batches are unfinished (with ``keep=0`` the jobs beside
        them too); the first failure."""
        failure: BaseException | None = None
        while len(self._pending) > keep:
            future, units = self._pending.pop(0)
            try:
                future.result()
            except Exception as exc:
                failure = _first(failure, exc)
                continue
            self._report.units_written += len(units)
            self._report.bytes_written += sum(_unit_bytes(self._plan, unit) for unit in units)
        if keep == 0:
            while self._beside_jobs:
                try:
                    self._beside_jobs.pop(0).result()
                except Exception as exc:
                    failure = _first(failure, exc)
        return failure

    def close(self) -> None:
        """Stop: batches not started are dropped, a running one is waited for."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._beside.shutdown(wait=True, cancel_futures=True)
