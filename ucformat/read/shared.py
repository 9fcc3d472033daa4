"""The loaders' one entry to collective reads: a batch read ``own`` or ``once``, and the job's
totals.

Every collective loader (``ucformat.deepspeed.load``, ``ucformat.torch.load`` on DTensors or
under ``torch.distributed``, and any binding that hands over its per-rank needs as a
:class:`~ucformat.read.batch.ReadBatch`) does the same three things:

1. :func:`read_batch`: read the batch ``own`` (each rank its items) or ``once``
   (:mod:`ucformat.read.once`: each chunk once, job-wide, then shared); ``read="auto"`` lets
   the job's plan decide (once where own reads would fetch more than 1 % over the chunks
   needed once: replicas, chunks cut by partitions). Returns this rank's failure instead of
   raising, so that the caller's agreement (:func:`ucformat.collective.settle`) makes every
   rank stop together;
2. the caller settles;
3. :func:`job_totals`: bytes and requests to storage, bytes exchanged and bytes needed,
   summed over the ranks (one gathering).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ucformat.collective import Group, gather_ints
from ucformat.errors import UCFormatError
from ucformat.layout.read_once import BlockPolicy, reads_cost
from ucformat.layout.reads import ReadCost
from ucformat.read.batch import ReadBatch, read_own
from ucformat.read.checkpoint import UniversalCheckpoint
from ucformat.read.once import (
    DEFAULT_BUDGET,
    MODES,
    GroupTransport,
    SharedPlan,
    SharedStats,
    execute_shared,
    plan_shared,
)

__all__ = [
    "JobReport",
    "JobTotals",
    "ReadOutcome",
    "check_mode",
    "job_totals",
    "plan_reads",
    "read_batch",
    "read_planned",
]


def check_mode(read: str) -> str:
    """``read`` if it is one of :data:`~ucformat.read.once.MODES`.

    Raises:
        UCFormatError: any other value.
    """
    if read not in MODES:
        raise UCFormatError(
            f"read={read!r} is not a read mode; give one of {', '.join(map(repr, MODES))} "
            "('auto': read each chunk once job-wide where ranks share chunks)."
        )
    return read


@dataclass
class ReadOutcome:
    """How a batch was read on this rank."""

    stats: SharedStats = field(default_factory=SharedStats)
    failure: BaseException | None = None
    #: What the read-cost model says this rank fetched as a reader (``once``), else None.
    planned: ReadCost | None = None


def plan_reads(
    ckpt: UniversalCheckpoint,
    needs: Mapping[str, Sequence[tuple[int, int]]],
    group: Group,
    *,
    read: str = "auto",
    budget: int = DEFAULT_BUDGET,
    policy: BlockPolicy | None = None,
) -> SharedPlan | None:
    """The job's read plan for these ``needs`` (per stored array path, the flat ranges this rank
    reads): ``plan.stats.mode`` is ``"once"``, or ``"own"`` where ``"auto"`` found little
    shared. None (no collective) for ``read="own"`` or a group of one; collective otherwise."""
    if check_mode(read) == "own" or not group.distributed:
        return None
    return plan_shared(ckpt, needs, GroupTransport(group), mode=read, budget=budget, policy=policy)


def read_planned(
    ckpt: UniversalCheckpoint, plan: SharedPlan | None, batch: ReadBatch, group: Group
) -> ReadOutcome:
    """Fill every item of ``batch`` as ``plan`` says (None or ``own``: this rank alone;
    ``once``: collective). Read failures are returned, not raised."""
    outcome = ReadOutcome()
    if plan is not None:
        outcome.stats = plan.stats
        if plan.stats.mode == "once":
            outcome.failure = execute_shared(ckpt, plan, batch, GroupTransport(group))
            outcome.planned = reads_cost(plan.rows, plan.grids)
            return outcome
    try:
        read_own(ckpt, batch)
    except (UCFormatError, OSError) as exc:
        outcome.failure = exc
    return outcome


def read_batch(
    ckpt: UniversalCheckpoint,
    batch: ReadBatch,
    group: Group,
    *,
    read: str = "auto",
    budget: int = DEFAULT_BUDGET,
    policy: BlockPolicy | None = None,
) -> ReadOutcome:
    """:func:`plan_reads` for the batch's needs, then :func:`read_planned`."""
    needs = {path: ranges for path, (_, ranges) in batch.needs().items()}
    plan = plan_reads(ckpt, needs, group, read=read, budget=budget, policy=policy)
    return read_planned(ckpt, plan, batch, group)


@dataclass(frozen=True)
class JobTotals:
    """A load summed over the ranks."""

    bytes_read: int
    requests: int
    bytes_exchanged: int
    bytes_needed: int


def job_totals(
    group: Group, bytes_read: int, requests: int, bytes_sent: int, bytes_needed: int
) -> JobTotals:
    """This rank's numbers summed over ``group`` (collective: one gathering)."""
    rows = gather_ints([bytes_read, requests, bytes_sent, bytes_needed], group)
    return JobTotals(*(sum(row[i] for row in rows) for i in range(4)))


@dataclass
class JobReport:
    """How a collective load read (the fields every loader's report has)."""

    #: ``"once"`` (each chunk read once job-wide, then shared over the process group) or
    #: ``"own"`` (each rank its own bytes): what ``read=`` of the loader came to.
    read_mode: str = "own"
    #: Bytes this rank sent to and received from other ranks (``"once"``).
    bytes_sent: int = 0
    bytes_received: int = 0
    #: Job-wide (summed over the ranks; None for a load in one process): bytes fetched from
    #: storage, requests, bytes exchanged, bytes needed (replicas counted each time).
    job_bytes_read: int | None = None
    job_requests: int | None = None
    job_bytes_exchanged: int | None = None
    job_bytes_needed: int | None = None
    #: Bytes of the chunks some rank needed, each chunk once (what storage must serve at the
    #: least); known where the job planned its reads together (``read`` not ``"own"``).
    job_chunk_bytes_needed: int | None = None

    def record(
        self,
        outcome: ReadOutcome,
        group: Group | None,
        bytes_read: int,
        requests: int,
        bytes_needed: int,
    ) -> None:
        """Fill the fields from ``outcome`` and, across ``group`` (collective when it has
        several ranks), the job's totals of this rank's numbers."""
        self.read_mode = outcome.stats.mode
        self.bytes_sent = outcome.stats.bytes_sent
        self.bytes_received = outcome.stats.bytes_received
        if outcome.stats.union_bytes:
            self.job_chunk_bytes_needed = outcome.stats.union_bytes
        if group is not None and group.distributed:
            totals = job_totals(group, bytes_read, requests, self.bytes_sent, bytes_needed)
            self.job_bytes_read, self.job_requests = totals.bytes_read, totals.requests
            self.job_bytes_exchanged = totals.bytes_exchanged
            self.job_bytes_needed = totals.bytes_needed
