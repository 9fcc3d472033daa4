"""Distributed ``convert``: every process of a ``torchrun`` job writes a share of the shards.

::

    torchrun --nnodes K --nproc_per_node N -m ucformat_cli convert SRC DST

Each process reads the checkpoint's metadata (the pickles; tensor bytes stay on disk) with the
single-process convert's own reader call and settings
(:class:`~ucformat.write.convert.ConvertSettings`) and makes the same plan as ``ucformat
convert``; the plan's write units are cut into one consecutive run
of about equal bytes per process (:func:`ucformat.layout.ownership.writers_by_balance`), so each
process reads about ``1/W`` of the source bytes, from whichever rank files its units need, and
writes its shards with the converter's writer. Rank 0 prepares the destination and commits the
manifest after every process has reported success (:mod:`ucformat.write.spread`); any
process's failure fails every process with the same error, and nothing is committed. SRC and
DST must be reachable from every node (a shared file system, or an object store URL).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ucformat.store.keys import StoreLike
    from ucformat.write.convert import ConvertHooks, ConvertSettings
    from ucformat.write.spread import SpreadReport

__all__ = ["JOIN_TIMEOUT_S", "convert_distributed", "join_process_group", "launched_distributed"]


def launched_distributed() -> bool:
    """Whether this process is one of several started by ``torchrun`` (or set up alike)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world > 1 and "RANK" in os.environ and "MASTER_ADDR" in os.environ


#: How long a process waits for the others to join (``UCFORMAT_JOIN_TIMEOUT_S``, seconds).
JOIN_TIMEOUT_S = 300.0


#: The rendezvous store of this process's joins, made once: a second join talks to the same
#: server (a new TCPStore server on the same port would fail while the first one lives).
_JOIN_STORE: list[Any] = []
#: Joins made by this process so far. Every process joins in the same order, so the number
#: names the same join everywhere; each join's keys live under their own prefix, because a
#: re-initialised default group would otherwise meet the keys the previous one left in the
#: store and some ranks would connect to a group the others have left (a hang).
_JOINS = itertools.count()


def join_process_group() -> None:
    """Join torchrun's process group (gloo), waiting at most ``UCFORMAT_JOIN_TIMEOUT_S``.

    May be called again after the group was destroyed (one join after another in one process).

    Raises:
        DistributedWriteError: the other processes did not join in time (one line).
    """
    from datetime import timedelta

    import torch.distributed as dist

    from ucformat.errors import DistributedWriteError

    seconds = float(os.environ.get("UCFORMAT_JOIN_TIMEOUT_S", JOIN_TIMEOUT_S))
    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    try:
        if not _JOIN_STORE:
            rendezvous = dist.rendezvous  # type: ignore[attr-defined]
            store, _, _ = next(rendezvous("env://", timeout=timedelta(seconds=seconds)))
            _JOIN_STORE.append(store)
        dist.init_process_group(
            backend="gloo",
            store=dist.PrefixStore(f"ucformat-join/{next(_JOINS)}", _JOIN_STORE[0]),  # type: ignore[attr-defined]
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timedelta(seconds=seconds),
        )
    except (
        RuntimeError,
        ValueError,
        KeyError,
    ) as exc:  # DistStoreError / DistNetworkError / timeouts
        raise DistributedWriteError(
            f"rank {rank} of {world}: the other processes did not join at {where} within "
            f"{seconds:.0f}s ({type(exc).__name__}); start all {world} with the same torchrun "
            "command, or set UCFORMAT_JOIN_TIMEOUT_S."
        ) from None


def convert_distributed(
    src: str | Path,
    dst: StoreLike,
    settings: ConvertSettings | None = None,
    *,
    hooks: ConvertHooks | None = None,
) -> SpreadReport:
    """``ucformat.convert`` run by every process of a distributed job; collective.

    Joins the default process group (``torch.distributed`` env:// settings, as torchrun sets
    them) if the caller has not, and leaves it again at the end in that case. ``settings`` are
    those of the single-process convert (:class:`~ucformat.write.convert.ConvertSettings`:
    the same reader call, layout, source check and durability); ``workers`` are each
    process's threads.

    Returns:
        This process's :class:`~ucformat.write.spread.SpreadReport` (``manifest`` is the
        committed one on rank 0).

    Raises:
        CollectiveError: some process failed (the same error on every process); nothing
            was committed.
    """
    import torch.distributed as dist  # here: launched_distributed() must not import torch

    from ucformat.collective import agree, group
    from ucformat.format.dtypes import itemsize
    from ucformat.layout.ownership import writers_by_balance
    from ucformat.store.keys import open_store
    from ucformat.write.convert import ConvertHooks, ConvertSettings
    from ucformat.write.plan import plan_convert
    from ucformat.write.spread import write_spread

    settings = settings or ConvertSettings()
    hooks = hooks or ConvertHooks()
    joined = False
    if not dist.is_initialized():
        join_process_group()
        joined = True
    try:
        ranks = group().operation()
        where = f"{dst}: ucformat convert"
        failure: Exception | None = None
        source = plan = target = None
        try:
            source = settings.read(src)
            plan = plan_convert(source, settings.layout())
            target = open_store(dst, read_only=False)
        except Exception as exc:  # every process must learn of it
            failure = exc
        try:
            error = agree(failure, ranks, where)
            if error is not None:
                raise error from failure
            assert plan is not None
            assert target is not None
            assert source is not None
            if hooks.on_plan is not None:
                hooks.on_plan(plan)
            sizes = [unit.numel * itemsize(plan.arrays[unit.array].dtype) for unit in plan.units]
            return write_spread(
                plan,
                target,
                writers=writers_by_balance(sizes, ranks.world_size),
                group=ranks,
                where=where,
                overwrite=settings.overwrite,
                workers=settings.workers,
                progress=hooks.on_bytes,
                fsync=settings.fsync,
                before_commit=source.check_integrity,  # a damaged source fails every process
            )
        finally:
            if source is not None:
                source.close()
    finally:
        if joined:
            dist.destroy_process_group()
