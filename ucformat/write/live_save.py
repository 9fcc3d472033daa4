"""The one tail of every live save (``ucformat.deepspeed.save``, ``ucformat.torch.save``).

A binding only turns its framework's live state into a plan; the rest is the same for all:

1. :func:`prepare_live_save` (collective, in the caller's thread): the binding's ``plan``
   callback describes the live state as fragments and plans the store; the writer of each unit
   is chosen by holdings (:func:`~ucformat.layout.ownership.writers_by_holdings`) and the store
   is opened; every rank then agrees that every rank got this far
   (:func:`~ucformat.collective.settle`: one :class:`~ucformat.errors.CollectiveError` on every
   rank otherwise, and nothing is written). **Plans are kept**: per ``owner`` (the engine or
   the model saved) the layout of the last save's plan and its writers are kept
   (:class:`~ucformat.write.plan.PlanLayout`, weakly: they go with the owner); the next save
   passes it to the planner, which takes it as it is when the live state has the same layout
   key (names, shapes, dtypes, fragments and their holders, options: checked in one pass over
   the fragments), so a save of an unchanged layout decides nothing again (no chunking,
   stacking, validation of its arrays or writer choice) and only binds the units to this
   save's tensors;
2. :func:`write_live_save` (collective, in the caller's thread for ``save``, in the background
   thread of :mod:`ucformat.write.background` for ``save_async``): the plan spread over the
   ranks (:func:`~ucformat.write.spread.write_spread`: exchange of straddling shards, one commit
   after agreement).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ucformat.collective import Group, group, settle
from ucformat.format.models import CheckpointManifest
from ucformat.layout.ownership import writers_by_holdings
from ucformat.sources.live import HostCopies
from ucformat.store.keys import StoreLike, open_store
from ucformat.write.plan import ConvertPlan, PlanLayout
from ucformat.write.spread import SpreadReport, holdings, write_spread

__all__ = ["LiveSave", "LiveTarget", "SaveReport", "prepare_live_save", "write_live_save"]


@dataclass
class SaveReport:
    """What a live save did on this rank: the one result of every ``save`` and ``save_async``
    (``ucformat.deepspeed``, ``ucformat.torch``)."""

    #: The store as the caller named it.
    store: str
    #: The committed manifest (rank 0), or the manifest this rank planned (the same content).
    manifest: CheckpointManifest
    #: True on the rank that committed the manifest (rank 0).
    committed: bool
    units_written: int
    bytes_written: int
    bytes_sent: int
    bytes_received: int
    exchange_rounds: int
    #: Bytes this rank copied to host memory (``save_async``: everything it writes; ``save``:
    #: only tensors that live on a device).
    host_copy_bytes: int
    #: Of them, the bytes copied from a device into pinned (page-locked) memory.
    pinned_bytes: int
    #: Seconds the caller was blocked (``save``: the whole save; ``save_async``: the copy).
    blocked_seconds: float
    #: Seconds from the call to the commit.
    seconds: float
    #: Whether the save took the layout kept from this owner's previous save (True), or
    #: planned anew (the first save, or the layout changed).
    plan_kept: bool = False


@dataclass(frozen=True)
class LiveTarget:
    """Where a live save goes and who takes part: what the binding's plan callback gets."""

    #: The store as the caller named it.
    location: str
    #: ``"<location>: <api>"``, the prefix of every message of this save.
    where: str
    #: ucformat's private group of the ranks taking part.
    group: Group
    #: Host copies of the tensors written (all of them for ``save_async``).
    copies: HostCopies


@dataclass(frozen=True)
class LiveSave:
    """A live save every rank has prepared: its plan, the writer of each unit, the store."""

    target: LiveTarget
    plan: ConvertPlan
    writers: list[int]
    store: Any
    #: Whether the plan took the layout kept from the owner's previous save.
    kept: bool = False


@dataclass(frozen=True)
class _Kept:
    """What a live save keeps of its plan for the owner's next save: the layout and the
    writers of its units, for a world of ``world_size`` ranks."""

    layout: PlanLayout
    writers: list[int]
    world_size: int


#: Per owner (an engine, a model), the kept plan of its last save; weakly, so that it goes
#: with the owner.
_KEPT: weakref.WeakKeyDictionary[Any, _Kept] = weakref.WeakKeyDictionary()


def _kept(owner: Any) -> _Kept | None:
    """The plan kept for ``owner`` (None: none yet, or an owner that cannot be referenced
    weakly, whose plans are not kept)."""
    try:
        return _KEPT.get(owner)
    except TypeError:
        return None


def _keep(owner: Any, kept: _Kept) -> None:
    with contextlib.suppress(TypeError):  # an owner without weak references keeps nothing
        _KEPT[owner] = kept


def prepare_live_save(
    store: StoreLike,
    *,
    api: str,
    copy_all: bool,
    owner: Any,
    plan: Callable[[LiveTarget, PlanLayout | None], ConvertPlan],
) -> LiveSave:
    """Plan the save on this rank and agree that every rank could (collective).

    Args:
        store: the destination (path, URL or zarr ``Store``), the same on every rank.
        api: the public function, for messages (``"ucformat.torch.save"``).
        copy_all: copy every tensor written to host memory now (``save_async``).
        owner: what is saved (the engine or the model): the plan's layout is kept per owner
            for its next save.
        plan: the binding's describe-and-plan step; it gets the layout kept from the owner's
            previous save (None for the first), to pass to
            :func:`~ucformat.write.plan.plan_convert`.

    Raises:
        CollectiveError: some rank failed (one process: its own error), on every rank.
    """
    location = str(store)
    ranks = group().operation()
    target = LiveTarget(location, f"{location}: {api}", ranks, HostCopies(always=copy_all))
    failure: Exception | None = None
    prepared: LiveSave | None = None
    try:
        kept = _kept(owner)
        if kept is not None and kept.world_size != ranks.world_size:
            kept = None
        planned = plan(target, None if kept is None else kept.layout)
        reused = kept is not None and planned.layout is kept.layout
        if kept is not None and reused:
            writers = kept.writers
        else:
            writers = writers_by_holdings(holdings(planned), ranks.world_size)
            if planned.layout is not None:
                _keep(owner, _Kept(planned.layout, writers, ranks.world_size))
        prepared = LiveSave(
            target, planned, writers, open_store(store, read_only=False), kept=reused
        )
    except Exception as exc:  # every rank must learn of it
        failure = exc
    settle(failure, ranks, target.where)
    assert prepared is not None
    return prepared


def write_live_save(
    save: LiveSave,
    *,
    overwrite: bool,
    workers: int,
    exchange_budget: int,
    fsync: bool = True,
    started: float,
    blocked: float | None = None,
) -> SaveReport:
    """Write the prepared save spread over its ranks and commit once all agree (collective).

    ``fsync``: make a local store durable before and at the commit (docs/format.md §6).
    ``started``: the ``time.perf_counter()`` of the public call; ``blocked``: the seconds the
    caller was blocked (``save_async``: its copy), or None when it waited for the whole save.
    """
    spread: SpreadReport = write_spread(
        save.plan,
        save.store,
        writers=save.writers,
        group=save.target.group,
        where=save.target.where,
        overwrite=overwrite,
        workers=workers,
        exchange_budget=exchange_budget,
        overwrite_hint="overwrite=True",
        fsync=fsync,
    )
    seconds = time.perf_counter() - started
    return SaveReport(
        store=save.target.location,
        manifest=spread.manifest or save.plan.manifest,
        committed=spread.committed,
        units_written=spread.units_written,
        bytes_written=spread.bytes_written,
        bytes_sent=spread.bytes_sent,
        bytes_received=spread.bytes_received,
        exchange_rounds=spread.exchange_rounds,
        host_copy_bytes=save.target.copies.nbytes,
        pinned_bytes=save.target.copies.pinned_bytes,
        blocked_seconds=seconds if blocked is None else blocked,
        seconds=seconds,
        plan_kept=save.kept,
    )
