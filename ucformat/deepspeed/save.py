"""``ucformat.deepspeed.save`` / ``save_async``: write a live engine straight into a store.

Call on every rank where you would call ``engine.save_checkpoint``::

    report = ucformat.deepspeed.save(engine, "ckpt/step800.ucf", client_state={"step": 800})

    handle = ucformat.deepspeed.save_async(engine, "s3://bucket/step800.ucf")
    ...                                  # training goes on while the store is written
    handle.result()                      # the SaveReport, or the error every rank raised

Each rank writes the shards its own flat partitions cover, from its fp32 partitions and
optimizer states, with the converter's planner and shard writer: no native files, no temporary
files, no all-gather of parameters. A shard that straddles two ranks' partitions is written by
the rank holding most of it; the runs it lacks come from their holders over a private gloo
group (:mod:`ucformat.write.spread`). Rank 0 commits the manifest once every rank has
written its part; a failure on any rank raises the same
:class:`~ucformat.errors.CollectiveError` on every rank, and nothing is committed. The
store equals what ``ucformat convert`` makes of ``engine.save_checkpoint``'s files, array for
array and manifest for manifest, apart from the provenance (``source``: ``written_by="save"``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ucformat.deepspeed.engine import describe_engine
from ucformat.deepspeed.source import describe_live
from ucformat.errors import UnsupportedCheckpointError
from ucformat.store.keys import StoreLike
from ucformat.sysio.collector import collection_paused
from ucformat.write import background
from ucformat.write.execute import DEFAULT_WORKERS
from ucformat.write.live_save import (
    LiveSave,
    LiveTarget,
    SaveReport,
    prepare_live_save,
    write_live_save,
)
from ucformat.write.plan import ConvertPlan, PlanLayout, plan_convert
from ucformat.write.spread import DEFAULT_EXCHANGE_BUDGET

__all__ = ["SaveHandle", "SaveReport", "save", "save_async"]


#: The handle :func:`save_async` returns (its ``result()`` is the :class:`SaveReport`).
SaveHandle = background.SaveHandle


def _prepare(
    engine: Any,
    store: StoreLike,
    client_state: Mapping[str, Any] | None,
    *,
    copy_all: bool,
    tag: str | None,
    chunk_bytes: int | None,
    shard_bytes: int | None,
    compressor: str,
) -> LiveSave:
    """Describe the engine, plan the store and agree that every rank could (collective)."""
    from ucformat.write.convert import convert_options

    def plan(target: LiveTarget, kept: PlanLayout | None) -> ConvertPlan:
        if getattr(engine, "has_moe_layers", False):
            raise UnsupportedCheckpointError(
                f"{target.where}: live saves of MoE engines are not supported yet; save with "
                "engine.save_checkpoint and run 'ucformat convert' on it (docs/parallel.md)."
            )
        source = describe_live(
            describe_engine(engine),
            rank=target.group.rank,
            world_size=target.group.world_size,
            client_state=client_state,
            location=target.location,
            tag=tag,
            copies=target.copies,
        )
        options = convert_options(chunk_bytes, shard_bytes, compressor)
        return plan_convert(source, options, kept)

    return prepare_live_save(
        store, api="ucformat.deepspeed.save", copy_all=copy_all, owner=engine, plan=plan
    )


def save(
    engine: Any,
    store: StoreLike,
    *,
    client_state: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    tag: str | None = None,
    chunk_bytes: int | None = None,
    shard_bytes: int | None = None,
    compressor: str = "none",
    workers: int = DEFAULT_WORKERS,
    exchange_budget: int = DEFAULT_EXCHANGE_BUDGET,
    fsync: bool = True,
) -> SaveReport:
    """Save a DeepSpeed ZeRO engine into a ucformat store, every rank writing its own part.

    Call on every rank (it is collective), where ``engine.save_checkpoint`` would be called.

    Args:
        engine: the ``DeepSpeedEngine`` (ZeRO stage 1, 2 or 3; fp32, fp16 or bf16; any
            optimizer wrapper :func:`ucformat.deepspeed.load` supports).
        store: a local path, an fsspec URL or a zarr ``Store``, the same on every rank; local
            paths must be on a file system every rank sees.
        client_state: JSON-like values saved with the checkpoint (as ``save_checkpoint``'s);
            rank 0's are kept; values without an exact JSON form are recorded by type.
        overwrite: replace an existing ucformat store.
        tag: recorded as the source tag (default ``global_step<N>``).
        chunk_bytes: inner chunk target; default as ``ucformat convert`` (64 KiB).
        shard_bytes: shard target; default as ``ucformat convert`` (16 MiB).
        compressor: ``"none"`` or ``"zstd"``.
        workers: threads writing this rank's shards.
        exchange_budget: bytes of straddling shards a rank holds at a time during the exchange
            (rounds move half of it, so one round is written while the next is exchanged).
        fsync: make a local store durable (every object and directory fsynced before the
            commit, the manifest after it: docs/format.md §6), which ``save_checkpoint`` and
            ``dcp.save`` do not do; ``False`` leaves the writeback to the OS (faster where the
            disk is slower than memory; a power loss may then lose a committed store).

    Returns:
        This rank's :class:`SaveReport`.

    Raises:
        CollectiveError: any rank failed (the same error on every rank, naming it);
            nothing was committed, and a local store the save created is removed.
    """
    started = time.perf_counter()
    background.wait_for_pending()
    with collection_paused():
        prepared = _prepare(
            engine, store, client_state, copy_all=False, tag=tag, chunk_bytes=chunk_bytes,
            shard_bytes=shard_bytes, compressor=compressor,
        )  # fmt: skip
        return write_live_save(
            prepared, overwrite=overwrite, workers=workers, exchange_budget=exchange_budget,
            fsync=fsync, started=started, blocked=None,
        )  # fmt: skip


def save_async(
    engine: Any,
    store: StoreLike,
    *,
    client_state: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    tag: str | None = None,
    chunk_bytes: int | None = None,
    shard_bytes: int | None = None,
    compressor: str = "none",
    workers: int = DEFAULT_WORKERS,
    exchange_budget: int = DEFAULT_EXCHANGE_BUDGET,
    fsync: bool = True,
) -> background.SaveHandle[SaveReport]:
    """Like :func:`save`, but return once this rank's state is copied to host memory.

    First waits for this process's previous ``save_async``. Then, in the calling thread: the
    plan and manifest are made and every tensor the rank writes is copied to host memory
    (pinned when it lives on a GPU): about one rank's partitions (fp32 + optimizer states) plus,
    on rank 0, buffers and frozen parameters. The writing, the exchange of straddling shards and
    the commit happen in a background thread, on ucformat's private gloo group, while training
    goes on. Call ``handle.result()`` before ``torch.distributed.destroy_process_group``.

    If the process dies before the commit, the store has no manifest: every reader refuses it
    as incomplete, and the next save with ``overwrite=True`` replaces it.

    Returns:
        A :class:`SaveHandle`; ``result()`` gives the :class:`SaveReport` or raises the error.

    Raises:
        CollectiveError: a rank could not describe or copy its state (before anything
            was written).
    """
    started = time.perf_counter()
    background.wait_for_pending()
    with collection_paused():
        prepared = _prepare(
            engine, store, client_state, copy_all=True, tag=tag, chunk_bytes=chunk_bytes,
            shard_bytes=shard_bytes, compressor=compressor,
        )  # fmt: skip
    blocked = time.perf_counter() - started
    return background.start(
        lambda: write_live_save(
            prepared,
            overwrite=overwrite,
            workers=workers,
            exchange_budget=exchange_budget,
            fsync=fsync,
            started=started,
            blocked=blocked,
        )
    )
