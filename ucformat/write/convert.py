"""``ucformat.convert``: a DeepSpeed ZeRO checkpoint or a PyTorch DCP folder in, a committed
ucformat store out."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ucformat.format.models import CheckpointManifest
from ucformat.layout.chunking import ChunkPolicy
from ucformat.sources.detect import read_source
from ucformat.sources.safe_unpickle import PicklePolicy
from ucformat.store.keys import (
    StoreLike,
    open_store,
    store_writes,
)
from ucformat.store.lifecycle import discard_store, start_store
from ucformat.store.locations import local_source
from ucformat.store.manifest_io import commit_manifest
from ucformat.write.execute import DEFAULT_WORKERS, create_arrays, write_units
from ucformat.write.plan import ConvertOptions, ConvertPlan, plan_convert

if TYPE_CHECKING:
    from ucformat.sources.base import SourceCheckpoint

__all__ = [
    "ConvertHooks",
    "convert",
    "convert_options",
    "plan_from_source",
]


@dataclass
class ConvertHooks:
    """Callbacks for progress reporting (all optional)."""

    on_plan: Callable[[ConvertPlan], None] | None = None
    on_bytes: Callable[[int], None] | None = None
    #: Called with what happens next once every byte is written (the source check, the commit).
    on_phase: Callable[[str], None] | None = None


def plan_from_source(
    src: str | Path,
    *,
    tag: str | None = None,
    chunk_bytes: int | None = None,
    shard_bytes: int | None = None,
    compressor: str = "none",
    opaque_globals: Iterable[str] = (),
    model_key: str | None = None,
    optimizer_key: str | None = None,
    tp_max: int | None = None,
    head_dim: int | None = None,
) -> ConvertPlan:
    """Read ``src``'s metadata and plan its conversion, without writing anything."""
    # a dry run reads no tensor bytes: nothing to checksum
    with _read(
        src, tag, opaque_globals, model_key, optimizer_key, check_crc=False, head_dim=head_dim
    ) as source:
        return plan_convert(source, _options(chunk_bytes, shard_bytes, compressor, tp_max))


def convert(
    src: str | Path,
    dst: StoreLike,
    *,
    tag: str | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    chunk_bytes: int | None = None,
    shard_bytes: int | None = None,
    compressor: str = "none",
    workers: int = DEFAULT_WORKERS,
    opaque_globals: Iterable[str] = (),
    hooks: ConvertHooks | None = None,
    check_source: bool = True,
    fsync: bool = True,
    model_key: str | None = None,
    optimizer_key: str | None = None,
    tp_max: int | None = None,
    head_dim: int | None = None,
) -> CheckpointManifest:
    """Convert a DeepSpeed ZeRO checkpoint or a PyTorch Distributed Checkpoint into a store.

    Args:
        src: the DeepSpeed checkpoint's tag folder, or the run folder holding ``latest``; or a
            folder written by ``torch.distributed.checkpoint.save`` (it has ``.metadata``),
            detected automatically.
        dst: a local path, an fsspec URL, or a zarr ``Store``.
        tag: the tag to convert when ``src`` is a run folder (default: ``latest``).
        overwrite: replace an existing ucformat store at ``dst``.
        dry_run: plan and validate only; write nothing.
        chunk_bytes: inner chunk target (read granularity); default 64 KiB.
        shard_bytes: shard target (storage object size); default 16 MiB.
        compressor: ``"none"`` or ``"zstd"``.
        workers: threads writing shards concurrently (default: the CPU count, at most 4).
        opaque_globals: extra pickle globals to keep as inert placeholders (client state).
        hooks: progress callbacks.
        check_source: checksum every source byte as it is read and compare each tensor storage
            read with its file's zip CRC-32 before committing (a damaged shard file is an
            error, not a converted value); ``dry_run`` reads no tensor bytes, so checks none.
        fsync: on a local store, make every shard, directory and the manifest durable around
            the commit (docs/format.md §6); off only for benchmarks and scratch stores.
        model_key: DCP only: prefix of the model weights (default ``model``, else torchtitan's
            top-level keys; ``.`` names the top level).
        optimizer_key: DCP only: prefix of the optimizer state (default ``optimizer``/``optim``).
        tp_max: the largest tensor-parallel degree loads should read lean at: matrices of at
            least 1 MiB get box chunks of ``ceil(columns / tp_max)`` columns (default 8; 1
            gives flat-contiguous chunks only; docs/format.md §2.2).
        head_dim: DCP / torch_checkpointing only: torchtitan's ``fuse_qkv`` checkpoints (weights
            saved split, optimizer state fused) are rejoined with heads of this many rows.

    Returns:
        The committed manifest (for ``dry_run``, the manifest that would be written).

    Raises:
        UCFormatError: any problem with the source or the destination (one-line message).

    Example:
        >>> manifest = ucformat.convert("runs/gpt/global_step800", "ckpt.ucf")  # doctest: +SKIP
    """
    hooks = hooks or ConvertHooks()
    with _read(
        src, tag, opaque_globals, model_key, optimizer_key, check_crc=check_source,
        head_dim=head_dim,
    ) as source:  # fmt: skip
        plan = plan_convert(source, _options(chunk_bytes, shard_bytes, compressor, tp_max))
        if hooks.on_plan is not None:
            hooks.on_plan(plan)
        if dry_run:
            return plan.manifest
        store = open_store(dst, read_only=False)
        created = start_store(store, overwrite, plan.manifest.format_version)
        try:
            with store_writes(store, "writing the arrays"):
                arrays = create_arrays(store, plan)
                write_units(
                    plan, arrays, plan.units, workers=workers, progress=hooks.on_bytes,
                    writeback=fsync,
                )  # fmt: skip
            if hooks.on_phase is not None:
                hooks.on_phase("checking the source's CRC-32s")
            source.check_integrity()  # before the commit: a damaged source never looks complete
            if hooks.on_phase is not None:
                hooks.on_phase("committing (fsync of every object)" if fsync else "committing")
            return commit_manifest(store, plan.manifest, durable=fsync)
        except BaseException:
            discard_store(store, created)
            raise


def convert_options(
    chunk_bytes: int | None = None,
    shard_bytes: int | None = None,
    compressor: str = "none",
    tp_max: int | None = None,
) -> ConvertOptions:
    """The layout options ``convert`` uses for these targets (None: the defaults)."""
    return _options(chunk_bytes, shard_bytes, compressor, tp_max)


def _options(
    chunk_bytes: int | None, shard_bytes: int | None, compressor: str, tp_max: int | None = None
) -> ConvertOptions:
    default = ChunkPolicy()
    chunk = chunk_bytes or default.chunk_bytes
    shard = shard_bytes or max(default.shard_bytes, chunk)
    if compressor not in ("none", "zstd"):
        raise ValueError(f"compressor must be 'none' or 'zstd', got {compressor!r}")
    if tp_max is not None and tp_max < 1:
        raise ValueError(f"tp_max must be at least 1, got {tp_max}")
    policy = ChunkPolicy(chunk, shard, tp_max=tp_max or default.tp_max)
    return ConvertOptions(policy=policy, compressor=compressor)


def _read(
    src: str | Path,
    tag: str | None,
    opaque_globals: Iterable[str],
    model_key: str | None,
    optimizer_key: str | None,
    *,
    check_crc: bool,
    head_dim: int | None = None,
) -> SourceCheckpoint:
    """The source at ``src`` (a local folder), opened by the reader its files call for."""
    return read_source(
        local_source(src),
        tag=tag,
        policy=_pickle_policy(opaque_globals),
        model_key=model_key,
        optimizer_key=optimizer_key,
        check_crc=check_crc,
        head_dim=head_dim,
    )


def _pickle_policy(opaque_globals: Iterable[str]) -> PicklePolicy:
    names = frozenset(opaque_globals)
    return PicklePolicy(opaque_globals=names - {"*"}, all_unknown_opaque="*" in names)
