"""``ucformat convert SRC DST``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ucformat.format.summary import format_bytes

from ._errors import Left, interruptible, left_at

if TYPE_CHECKING:
    from ucformat.format.models import CheckpointManifest
    from ucformat.write.convert import ConvertSettings
    from ucformat.write.plan import ConvertPlan

_KIB = 1024
#: How the summary line names a converted format (``source.checkpoint_format``).
_FORMATS = {
    "torch-dcp": "PyTorch DCP",
    "megatron-torch_dist": "Megatron-Core torch_dist",
    "torch-checkpointing": "torch_checkpointing",
}


def _interrupted(options: dict[str, object]) -> Left:
    """The Ctrl-C line: what is really on disk at DST, read from the disk (docs/format.md §6.2);
    a write this process had committed makes the command exit 0."""
    dst = str(options.get("dst"))
    return left_at(
        dst,
        bool(options.get("dry_run")),
        f"the write was committed before the interrupt; {dst} is complete.",
        f"nothing was committed; {dst} may hold an uncommitted store, which readers refuse "
        "(re-run with --overwrite).",
    )


@interruptible(_interrupted)
def convert_command(
    src: Annotated[
        str,
        typer.Argument(
            help="The checkpoint, a local folder: DeepSpeed ZeRO (tag folder, or run folder with "
            "'latest'), PyTorch DCP (has .metadata: FSDP2, torchtitan, Lightning), Megatron-Core "
            "torch_dist, or an Accelerate save_state folder."
        ),
    ],
    dst: Annotated[str, typer.Argument(help="Destination store: a path or an fsspec URL.")],
    tag: Annotated[
        str | None,
        typer.Option(
            help="Tag to convert when SRC is a run folder [default: the one 'latest' names]."
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing store.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Plan and validate; write nothing.")
    ] = False,
    chunk_kib: Annotated[
        int | None,
        typer.Option(help="Inner chunk target in KiB (read granularity) [default: 64].", min=1),
    ] = None,
    shard_mib: Annotated[
        int | None,
        typer.Option(
            help="Shard target in MiB (object size) [default: 16, at least one chunk].", min=1
        ),
    ] = None,
    compress: Annotated[str, typer.Option(help="Chunk compression: none or zstd.")] = "none",
    tp_max: Annotated[
        int | None,
        typer.Option(
            help="Largest tensor-parallel degree loads stay lean at: matrices of 1 MiB or more "
            "get box chunks of columns/N columns [default: 8]; 1: flat chunks only.",
            min=1,
        ),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(help="Threads writing shards [default: CPU count, at most 4].", min=1),
    ] = None,
    opaque_global: Annotated[
        list[str] | None,
        typer.Option(
            help="Pickle global (module.Name) to keep as an inert placeholder; '*' for all. "
            "Repeatable."
        ),
    ] = None,
    no_check_source: Annotated[
        bool,
        typer.Option(
            "--no-check-source",
            help="Skip the CRC-32 check of the source files' tensor bytes (a damaged shard "
            "is then converted as it is).",
        ),
    ] = False,
    model_key: Annotated[
        str | None,
        typer.Option(
            help="DCP only: key of the model state dict [default: 'model', else torchtitan's "
            "top-level keys]; '.' for the top level."
        ),
    ] = None,
    optimizer_key: Annotated[
        str | None,
        typer.Option(help="DCP only: key of the optimizer state dict [default: optimizer/optim]."),
    ] = None,
    head_dim: Annotated[
        int | None,
        typer.Option(
            help="DCP / torch_checkpointing only: the head dimension that rejoins torchtitan's "
            "fuse_qkv weights (saved split as wq/wk/wv beside the fused wqkv optimizer state); "
            "torchtitan's dim // n_heads.",
            min=1,
        ),
    ] = None,
    distributed: Annotated[
        bool,
        typer.Option(
            "--distributed",
            help="One process of a distributed convert launched by torchrun: every process "
            "writes a share of the shards, rank 0 commits.",
        ),
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Convert a checkpoint (DeepSpeed ZeRO-1/2/3, PyTorch DCP, Megatron-Core) into a store.

    With --distributed, under torchrun, every process writes a share of the shards and rank 0
    commits: torchrun [--nnodes K] --nproc_per_node N -m ucformat_cli convert --distributed
    SRC DST. Without it, the convert runs in this process only, even when torchrun's
    environment (WORLD_SIZE, RANK, MASTER_ADDR) is set.
    """
    from ucformat.write.convert import ConvertHooks, ConvertSettings, run_convert
    from ucformat.write.distributed_convert import launched_distributed
    from ucformat.write.execute import DEFAULT_WORKERS

    if distributed and not launched_distributed():
        raise typer.BadParameter(
            "needs torchrun's environment (WORLD_SIZE > 1, RANK, MASTER_ADDR); launch it as "
            "'torchrun --nproc_per_node N -m ucformat_cli convert --distributed SRC DST'",
            param_hint="--distributed",
        )
    if compress not in ("none", "zstd"):
        raise typer.BadParameter("must be 'none' or 'zstd'", param_hint="--compress")
    settings = ConvertSettings(  # every option, for either convert: none can be dropped
        tag=tag,
        overwrite=overwrite,
        chunk_bytes=chunk_kib * _KIB if chunk_kib else None,
        shard_bytes=shard_mib * _KIB * _KIB if shard_mib else None,
        compressor=compress,
        tp_max=tp_max,
        workers=workers or DEFAULT_WORKERS,
        opaque_globals=tuple(opaque_global or ()),
        check_source=not no_check_source,
        model_key=model_key,
        optimizer_key=optimizer_key,
        head_dim=head_dim,
    )
    if distributed and not dry_run:
        _convert_distributed(src, dst, settings)
        return

    console = Console(stderr=True)
    started = time.perf_counter()
    planned: list[ConvertPlan] = []
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=quiet or dry_run or not console.is_terminal,  # no stray lines in logs
        transient=True,
    ) as bar:
        task = bar.add_task("converting", total=None)

        def on_plan(plan: ConvertPlan) -> None:
            planned.append(plan)
            bar.update(task, total=plan.nbytes)

        manifest = run_convert(
            src,
            dst,
            settings,
            dry_run=dry_run,
            hooks=ConvertHooks(
                on_plan=on_plan,
                on_bytes=lambda n: bar.advance(task, n),
                on_phase=lambda phase: bar.update(task, description=phase),
            ),
        )
    plan = planned[0]
    shards = len(plan.units)
    arrays = len(manifest.arrays())  # the logical arrays (format 3.1 stacks them)
    what = "would write" if dry_run else "wrote"
    typer.echo(
        f"{what} {arrays} arrays ({shards} shards, {format_bytes(plan.nbytes)}) for "
        f"{len(manifest.params)} params from {_origin(manifest)} to {dst} in "
        f"{time.perf_counter() - started:.2f}s"
    )
    _notes(manifest)


def _origin(manifest: CheckpointManifest) -> str:
    """What the store was converted from, for the summary line (either convert)."""
    source = manifest.source
    if source.framework == "deepspeed":
        return (
            f"DeepSpeed ZeRO-{source.zero_stage} x{source.world_size} {source.train_dtype} "
            f"(tag {source.tag})"
        )
    if source.checkpoint_format == "safetensors":
        return f"Hugging Face safetensors {source.train_dtype}"
    kind = _FORMATS.get(source.checkpoint_format or "", "PyTorch DCP")
    return f"{kind} x{source.world_size} {source.train_dtype}"


def _notes(manifest: CheckpointManifest) -> None:
    """What the store could not carry as it was, said on stderr (either convert)."""
    if manifest.client_state.unrepresentable:
        kept_out = ", ".join(f"{k} ({t})" for k, t in manifest.client_state.unrepresentable.items())
        typer.echo(f"note: client state kept by key and type only: {kept_out}", err=True)
    megatron = manifest.megatron
    if megatron is not None and megatron.optimizer_sharding and not megatron.optimizer_stored:
        typer.echo(f"note: model only, no optimizer state: {megatron.optimizer_note}", err=True)


def _convert_distributed(src: str, dst: str, settings: ConvertSettings) -> None:
    """One process of ``torchrun -m ucformat_cli convert``: rank 0 prints the summary."""
    from ucformat.write.distributed_convert import convert_distributed

    started = time.perf_counter()
    report = convert_distributed(src, dst, settings)
    if report.committed and report.manifest is not None:
        typer.echo(
            f"wrote {len(report.manifest.params)} params from {_origin(report.manifest)} to "
            f"{dst} in {time.perf_counter() - started:.2f}s (rank 0 of a distributed convert: "
            f"{report.units_written} shards, {format_bytes(report.bytes_written)} written here)"
        )
        _notes(report.manifest)
