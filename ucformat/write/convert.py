"""``ucformat.convert``: a foreign checkpoint in (DeepSpeed ZeRO, PyTorch DCP, Megatron-Core,
the clients' folders), a committed ucformat store out.

Every option is one :class:`ConvertSettings`; :meth:`ConvertSettings.read` is the one reader call
and :meth:`ConvertSettings.layout` the one layout, shared with the distributed convert
(:mod:`ucformat.write.distributed_convert`). :func:`run_convert`: read the source, plan it,
start the store (:mod:`ucformat.store.lifecycle`), write every shard on a thread pool, check the
source's CRC-32s, commit (the manifest last, the staged store swapped into place); any failure
discards the staged write.
"""

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
    "ConvertSettings",
    "convert",
    "convert_options",
    "plan_from_source",
    "run_convert",
]


@dataclass
class ConvertHooks:
    """Callbacks for progress reporting (all optional)."""

    on_plan: Callable[[ConvertPlan], None] | None = None
    on_bytes: Callable[[int], None] | None = None
    #: Called with what happens next once every byte is written (the source check, the commit).
    on_phase: Callable[[str], None] | None = None


@dataclass(frozen=True)
class ConvertSettings:
    """Every option of a convert: the one options type of the single-process convert
    (:func:`run_convert`) and the distributed one
    (:func:`~ucformat.write.distributed_convert.convert_distributed`), so that neither can drop
    one. The fields are the keywords of :func:`convert`, where each is documented.
    """

    tag: str | None = None
    overwrite: bool = False
    chunk_bytes: int | None = None
    shard_bytes: int | None = None
    compressor: str = "none"
    tp_max: int | None = None
    workers: int = DEFAULT_WORKERS
    opaque_globals: tuple[str, ...] = ()
    check_source: bool = True
    fsync: bool = True
    model_key: str | None = None
    optimizer_key: str | None = None
    head_dim: int | None = None

    def layout(self) -> ConvertOptions:
        """The layout options of the plan (chunking, compression), checked."""
        return convert_options(self.chunk_bytes, self.shard_bytes, self.compressor, self.tp_max)

    def read(self, src: str | Path, *, tensors: bool = True) -> SourceCheckpoint:
        """The one reader call: the source at ``src`` (a local folder), opened by the reader its
        files call for, with these settings (``tensors=False``: a plan only, whose tensor bytes
        are never read, so there is nothing to checksum)."""
        return read_source(
            local_source(src),
            tag=self.tag,
            policy=_pickle_policy(self.opaque_globals),
            model_key=self.model_key,
            optimizer_key=self.optimizer_key,
            check_crc=self.check_source and tensors,
            head_dim=self.head_dim,
        )


def plan_from_source(src: str | Path, settings: ConvertSettings | None = None) -> ConvertPlan:
    """Read ``src``'s metadata and plan its conversion, without writing anything."""
    settings = settings or ConvertSettings()
    with settings.read(src, tensors=False) as source:
        return plan_convert(source, settings.layout())


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
    settings = ConvertSettings(
        tag=tag,
        overwrite=overwrite,
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
        compressor=compressor,
        tp_max=tp_max,
        workers=workers,
        opaque_globals=tuple(opaque_globals),
        check_source=check_source,
        fsync=fsync,
        model_key=model_key,
        optimizer_key=optimizer_key,
        head_dim=head_dim,
    )
    return run_convert(src, dst, settings, dry_run=dry_run, hooks=hooks)


def run_convert(
    src: str | Path,
    dst: StoreLike,
    settings: ConvertSettings,
    *,
    dry_run: bool = False,
    hooks: ConvertHooks | None = None,
) -> CheckpointManifest:
    """:func:`convert` with its options as one :class:`ConvertSettings` (what the CLI builds)."""
    hooks = hooks or ConvertHooks()
    layout = settings.layout()
    with settings.read(src, tensors=not dry_run) as source:
        plan = plan_convert(source, layout)
        if hooks.on_plan is not None:
            hooks.on_plan(plan)
        if dry_run:
            return plan.manifest
        store = open_store(dst, read_only=False)
        created = start_store(store, settings.overwrite, plan.manifest.format_version)
        try:
            with store_writes(store, "writing the arrays"):
                arrays = create_arrays(store, plan)
                write_units(
                    plan, arrays, plan.units, workers=settings.workers, progress=hooks.on_bytes,
                    writeback=settings.fsync,
                )  # fmt: skip
            if hooks.on_phase is not None:
                hooks.on_phase("checking the source's CRC-32s")
            source.check_integrity()  # before the commit: a damaged source never looks complete
            if hooks.on_phase is not None:
                what = "committing (fsync of every object)" if settings.fsync else "committing"
                hooks.on_phase(what)
            return commit_manifest(store, plan.manifest, durable=settings.fsync)
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
    default = ChunkPolicy()
    chunk = chunk_bytes or default.chunk_bytes
    shard = shard_bytes or max(default.shard_bytes, chunk)
    if compressor not in ("none", "zstd"):
        raise ValueError(f"compressor must be 'none' or 'zstd', got {compressor!r}")
    if tp_max is not None and tp_max < 1:
        raise ValueError(f"tp_max must be at least 1, got {tp_max}")
    policy = ChunkPolicy(chunk, shard, tp_max=tp_max or default.tp_max)
    return ConvertOptions(policy=policy, compressor=compressor)


def _pickle_policy(opaque_globals: Iterable[str]) -> PicklePolicy:
    names = frozenset(opaque_globals)
    return PicklePolicy(opaque_globals=names - {"*"}, all_unknown_opaque="*" in names)
