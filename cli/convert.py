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

from ._errors import interruptible

if TYPE_CHECKING:
    from ucformat.write.plan import ConvertPlan

_KIB = 1024
#: How the summary line names a converted format (``source.checkpoint_format``).
_FORMATS = {
    "torch-dcp": "PyTorch DCP",
    "megatron-torch_dist": "Megatron-Core torch_dist",
    "torch-checkpointing": "torch_checkpointing",
}
#: Set once the convert has committed (what a later Ctrl-C message says).
_COMMITTED: list[bool] = []


def _interrupted(options: dict[str, object]) -> str:
    """The Ctrl-C message: what is left on disk (docs/format.md §6.2)."""
    from ucformat.store.locations import local_directory

    dst = str(options.get("dst"))
    if any(_COMMITTED):
        left = f"the store was committed before the interrupt; {dst} is complete"
    elif options.get("dry_run"):
        left = "nothing was written"
    elif local_directory(dst) is not None:
        left = f"nothing was committed; {dst} is as it was (the staged write beside it was removed)"
    else:
        left = (
            f"nothing was committed; {dst} holds an uncommitted store that readers refuse "
            "(re-run with --overwrite)"
        )
    return f"{left}."


@interruptible(_interrupted)
def convert_command(
    src: Annotated[
        str,
        typer.Argument(
            help="DeepSpeed checkpoint (tag folder, or run folder with 'latest'), or a PyTorch "
            "Distributed Checkpoint folder (has .metadata); local."
        ),
    ],
    dst: Annotated[str, typer.Argument(help="Destination store: a path or an fsspec URL.")],
    tag: Annotated[
        str | None, typer.Option(help="Tag to convert when SRC is a run folder.")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing store.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Plan and validate; write nothing.")
    ] = False,
    chunk_kib: Annotated[
        int | None, typer.Option(help="Inner chunk target in KiB (read granularity).", min=1)
    ] = None,
    shard_mib: Annotated[
        int | None, typer.Option(help="Shard target in MiB (object size).", min=1)
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
    """Convert a DeepSpeed ZeRO-1/2/3 checkpoint or a PyTorch DCP folder into a ucformat store.

    With --distributed, under torchrun, every process writes a share of the shards and rank 0
    commits: torchrun [--nnodes K] --nproc_per_node N -m ucformat_cli convert --distributed
    SRC DST. Without it, the convert runs in this process only, even when torchrun's
    environment (WORLD_SIZE, RANK, MASTER_ADDR) is set.
    """
    from ucformat.write.convert import ConvertHooks, convert
    from ucformat.write.distributed_convert import launched_distributed
    from ucformat.write.execute import DEFAULT_WORKERS

    if distributed and not launched_distributed():
        raise typer.BadParameter(
            "needs torchrun's environment (WORLD_SIZE > 1, RANK, MASTER_ADDR); launch it as "
            "'torchrun --nproc_per_node N -m ucformat_cli convert --distributed SRC DST'",
            param_hint="--distributed",
        )
    if distributed and head_dim is not None:
        raise typer.BadParameter(
            "not with --distributed (convert the fuse_qkv checkpoint in one process)",
            param_hint="--head-dim",
        )
    if distributed and not dry_run:
        _convert_distributed(
            src, dst, tag, overwrite, chunk_kib, shard_mib, compress, workers, opaque_global,
            tp_max,
        )  # fmt: skip
        return

    if compress not in ("none", "zstd"):
        raise typer.BadParameter("must be 'none' or 'zstd'", param_hint="--compress")
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

        manifest = convert(
            src,
            dst,
            tag=tag,
            overwrite=overwrite,
            dry_run=dry_run,
            chunk_bytes=chunk_kib * _KIB if chunk_kib else None,
            shard_bytes=shard_mib * _KIB * _KIB if shard_mib else None,
            compressor=compress,
            workers=workers or DEFAULT_WORKERS,
            opaque_globals=opaque_global or (),
            check_source=not no_check_source,
            hooks=ConvertHooks(
                on_plan=on_plan,
                on_bytes=lambda n: bar.advance(task, n),
                on_phase=lambda phase: bar.update(task, description=phase),
            ),
            model_key=model_key,
            optimizer_key=optimizer_key,
            tp_max=tp_max,
            head_dim=head_dim,
        )
        _COMMITTED.append(not dry_run)
    plan = planned[0]
    source = manifest.source
    shards = len(plan.units)
    what = "would write" if dry_run else "wrote"
    origin = (
        f"DeepSpeed ZeRO-{source.zero_stage} x{source.world_size} {source.train_dtype} "
        f"(tag {source.tag})"
        if source.framework == "deepspeed"
        else f"Hugging Face safetensors {source.train_dtype}"
        if source.checkpoint_format == "safetensors"
        else f"{_FORMATS.get(source.checkpoint_format or '', 'PyTorch DCP')} "
        f"x{source.world_size} {source.train_dtype}"
    )
    typer.echo(
        f"{what} {len(plan.arrays)} arrays ({shards} shards, {format_bytes(plan.nbytes)}) for "
        f"{len(manifest.params)} params from {origin} to {dst} in "
        f"{time.perf_counter() - started:.2f}s"
    )
    if manifest.client_state.unrepresentable:
        kept_out = ", ".join(f"{k} ({t})" for k, t in manifest.client_state.unrepresentable.items())
        typer.echo(f"note: client state kept by key and type only: {kept_out}", err=True)
    megatron = manifest.megatron
    if megatron is not None and megatron.optimizer_sharding and not megatron.optimizer_stored:
        typer.echo(f"note: model only, no optimizer state: {megatron.optimizer_note}", err=True)


def _convert_distributed(
    src: str,
    dst: str,
    tag: str | None,
    overwrite: bool,
    chunk_kib: int | None,
    shard_mib: int | None,
    compress: str,
    workers: int | None,
    opaque_global: list[str] | None,
    tp_max: int | None = None,
) -> None:
    """One process of ``torchrun -m ucformat_cli convert``: rank 0 prints the summary."""
    from ucformat.write.distributed_convert import convert_distributed
    from ucformat.write.execute import DEFAULT_WORKERS

    started = time.perf_counter()
    report = convert_distributed(
        src,
        dst,
        tag=tag,
        overwrite=overwrite,
        chunk_bytes=chunk_kib * _KIB if chunk_kib else None,
        shard_bytes=shard_mib * _KIB * _KIB if shard_mib else None,
        compressor=compress,
        workers=workers or DEFAULT_WORKERS,
        opaque_globals=opaque_global or (),
        tp_max=tp_max,
    )
    if report.committed and report.manifest is not None:
        source = report.manifest.source
        typer.echo(
            f"wrote {len(report.manifest.params)} params from DeepSpeed ZeRO-{source.zero_stage} "
            f"x{source.world_size} {source.train_dtype} (tag {source.tag}) to {dst} in "
            f"{time.perf_counter() - started:.2f}s (rank 0 of a distributed convert: "
            f"{report.units_written} shards, {format_bytes(report.bytes_written)} written here)"
        )
