"""``ucformat export {safetensors,deepspeed-universal,deepspeed,dcp,accelerate,megatron} ...``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

from ucformat.errors import UnsupportedExportError

from ._errors import Left, interruptible, left_at
from ._plain import PlainCommand, PlainGroup

if TYPE_CHECKING:  # the exporters (and torch) are imported by the command that runs
    from ucformat.export import ExportHooks, ExportResult

export_app = typer.Typer(
    name="export",
    help="Write a store in another format: safetensors weights, DeepSpeed's universal "
    "checkpoint, a native DeepSpeed ZeRO checkpoint for a new world size, a PyTorch "
    "Distributed Checkpoint, an Accelerate save_state folder, or a Megatron-Core torch_dist "
    "checkpoint for a new TP x PP x EP.",
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help (defaults shown) and one-line usage errors
    cls=PlainGroup,
)

Store = Annotated[str, typer.Argument(help="A ucformat store: path or fsspec URL.")]
Out = Annotated[
    str,
    typer.Argument(help="Destination folder, or a URL (s3://...: written locally, then uploaded)."),
]
Overwrite = Annotated[
    bool,
    typer.Option("--overwrite", help="Replace the files this export writes in a non-empty OUT."),
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Plan and validate; write nothing.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]
Dtype = Annotated[
    str | None,
    typer.Option(help="Dtype of the floating weights: fp32, bf16 or fp16 [default: fp32]."),
]
SourceDtype = Annotated[
    str | None,
    typer.Option(
        help="Dtype of the weights: fp32, bf16 or fp16 [default: the source's training dtype]."
    ),
]
TrainDtype = Annotated[
    str | None,
    typer.Option(
        help="Training dtype of that job: fp32, bf16 or fp16 [default: the config's, else the "
        "source's]."
    ),
]


def _interrupted(options: dict[str, object]) -> Left:
    """The Ctrl-C line: what is really at OUT, read from the disk (docs/format.md §6.2); an
    export this process had committed makes the command exit 0."""
    out = str(options.get("out"))
    return left_at(
        out,
        bool(options.get("dry_run")),
        f"the export was complete before the interrupt; {out} holds it.",
        f"nothing was committed; objects uploaded to {out} before the interrupt may remain, "
        "without the files that mark a finished export (re-run with --overwrite).",
    )


@contextmanager
def _progress(label: str, quiet: bool, dry_run: bool) -> Iterator[ExportHooks]:
    console = Console(stderr=True)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(binary_units=True),
        TimeRemainingColumn(),
        console=console,
        disable=quiet or dry_run or not console.is_terminal,
        transient=True,
    ) as bar:
        from ucformat.export import ExportHooks

        task = bar.add_task(label, total=None)
        yield ExportHooks(
            on_plan=lambda total: bar.update(task, total=total),
            on_bytes=lambda count: bar.advance(task, count),
        )


def _exporters() -> ModuleType:
    import ucformat.export

    return ucformat.export


def _report(result: ExportResult) -> None:
    typer.echo(result.summary)
    for note in result.notes:
        typer.echo(f"note: {note}", err=True)


def _run(
    label: str, quiet: bool, dry_run: bool, job: Callable[[ExportHooks], ExportResult]
) -> None:
    with _progress(label, quiet, dry_run) as hooks:
        result = job(hooks)
    _report(result)


@interruptible(_interrupted)
def safetensors_command(
    store: Store,
    out: Out,
    dtype: Dtype = None,
    max_shard_size: Annotated[
        str, typer.Option(help="Largest file: 5GB = 5*10^9 bytes, 2GiB = 2*2^30.")
    ] = "5GB",
    tied: Annotated[
        str, typer.Option(help="Tied aliases: 'drop' (transformers' convention) or 'copy'.")
    ] = "drop",
    buffers: Annotated[
        bool, typer.Option("--buffers/--no-buffers", help="Include persistent buffers.")
    ] = True,
    names: Annotated[
        str,
        typer.Option(
            help="Tensor names: 'store' (as stored), 'hf-llama' or 'hf-mixtral' (a dense or MoE "
            "Megatron-Core GPT store as Hugging Face Llama / Mixtral: q/k/v and gate/up split, "
            "config.json)."
        ),
    ] = "store",
    overwrite: Overwrite = False,
    dry_run: DryRun = False,
    quiet: Quiet = False,
) -> None:
    """Consolidated weights as Hugging Face safetensors (sharded, with an index), streamed."""
    if tied not in ("drop", "copy"):
        raise typer.BadParameter("must be 'drop' or 'copy'", param_hint="--tied")
    _run(
        "exporting safetensors",
        quiet,
        dry_run,
        lambda hooks: _exporters().export_safetensors(
            store,
            out,
            dtype=dtype,
            max_shard_size=max_shard_size,
            tied="copy" if tied == "copy" else "drop",
            buffers=buffers,
            overwrite=overwrite,
            dry_run=dry_run,
            hooks=hooks,
            names=names,
        ),
    )


@interruptible(_interrupted)
def universal_command(
    store: Store,
    out: Out,
    tag: Annotated[
        str | None, typer.Option(help="Folder name [default: <source tag>_universal].")
    ] = None,
    overwrite: Overwrite = False,
    dry_run: DryRun = False,
    quiet: Quiet = False,
) -> None:
    """DeepSpeed's universal checkpoint folder (load with "load_universal": true)."""
    _run(
        "exporting DeepSpeed universal",
        quiet,
        dry_run,
        lambda hooks: _exporters().export_deepspeed_universal(
            store, out, tag=tag, overwrite=overwrite, dry_run=dry_run, hooks=hooks
        ),
    )


def _config(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise UnsupportedExportError(
            f"{path}: is not a JSON DeepSpeed config ({exc}); pass the config file the target "
            "job uses."
        ) from None
    if not isinstance(config, dict):
        raise UnsupportedExportError(f"{path}: a DeepSpeed config must be a JSON object.")
    return config


@interruptible(_interrupted)
def deepspeed_command(
    store: Store,
    out: Out,
    world_size: Annotated[
        int,
        typer.Option(
            help="Data-parallel ranks of the job that will load it (with --tp: all processes).",
            min=1,
        ),
    ],
    stage: Annotated[int, typer.Option(help="ZeRO stage of that job: 1, 2 or 3.")],
    dtype: TrainDtype = None,
    config: Annotated[
        Path | None,
        typer.Option(help="That job's DeepSpeed config JSON [default: the source's config]."),
    ] = None,
    tag: Annotated[
        str | None,
        typer.Option(
            help="Checkpoint tag [default: the source's, or <tag>_ws<W>_zero<S> when OUT "
            "already holds the source's tag]."
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace OUT/<tag> if it exists; other tags are kept."),
    ] = False,
    remove_previous: Annotated[
        bool,
        typer.Option(
            "--remove-previous",
            help="After the export, delete the tag folder 'latest' named before (kept by default).",
        ),
    ] = False,
    dry_run: DryRun = False,
    quiet: Quiet = False,
    tp: Annotated[
        int,
        typer.Option(
            "--tp",
            help="AutoTP degree of that job (docs/tensor-parallel.md); then --world-size counts "
            "all tp x dp processes. The shards follow the split rules the store (or "
            "--tp-layout) records; refused, naming the parameter, where they do not fix them.",
            min=1,
        ),
    ] = 1,
    ep_size: Annotated[
        int | None,
        typer.Option(
            "--ep-size",
            help="MoE stores: expert-parallel size of that job; writes DeepSpeed's expert "
            "files (docs/exports.md) [default: the source's].",
            min=1,
        ),
    ] = None,
    tp_layout: Annotated[
        str | None,
        typer.Option(
            "--tp-layout",
            help="A store converted from an AutoTP run of the same model whose split rules "
            "cut the shards (for a store without its own, e.g. from a data-parallel run).",
        ),
    ] = None,
) -> None:
    """A native DeepSpeed ZeRO checkpoint that a stock engine.load_checkpoint(OUT) loads.

    OUT may be a DeepSpeed run folder or a Hugging Face Trainer checkpoint-N folder: the new
    tag is written beside the old one and 'latest' repointed; nothing else there changes.
    """
    if tp > 1 or tp_layout is not None:
        from ucformat.errors import UnsupportedExportError
        from ucformat.export.deepspeed_tensor_parallel import export_deepspeed_tensor_parallel

        if config is not None or remove_previous or dry_run:
            raise UnsupportedExportError(
                "--tp does not combine with --config, --remove-previous or --dry-run yet."
            )
        files = export_deepspeed_tensor_parallel(
            store, out, world_size=world_size, tp=tp, stage=stage, dtype=dtype, tag=tag,
            overwrite=overwrite, tp_layout=tp_layout,
        )  # fmt: skip
        typer.echo(f"wrote DeepSpeed AutoTP tp{tp} x dp{world_size // tp} ZeRO-{stage} "
                   f"checkpoint ({len(files)} files) to {out}")  # fmt: skip
        return
    ds_config = _config(config)
    _run(
        "exporting DeepSpeed ZeRO",
        quiet,
        dry_run,
        lambda hooks: _exporters().export_deepspeed(
            store,
            out,
            world_size=world_size,
            stage=stage,
            dtype=dtype,
            ds_config=ds_config,
            tag=tag,
            overwrite=overwrite,
            remove_previous=remove_previous,
            dry_run=dry_run,
            hooks=hooks,
            ep_size=ep_size,
        ),
    )


@interruptible(_interrupted)
def dcp_command(
    store: Store,
    out: Out,
    world_size: Annotated[
        int | None,
        typer.Option(
            help="Ranks whose FSDP2 shards the files hold [default: the source's].", min=1
        ),
    ] = None,
    layout: Annotated[
        str,
        typer.Option(
            help="Optimizer dict: 'flat' (flatten_optimizer_state_dict=True) or 'nested'."
        ),
    ] = "flat",
    overwrite: Overwrite = False,
    dry_run: DryRun = False,
    quiet: Quiet = False,
) -> None:
    """A PyTorch Distributed Checkpoint that stock dcp.load reads at any world size."""
    if layout not in ("flat", "nested"):
        raise typer.BadParameter("must be 'flat' or 'nested'", param_hint="--layout")
    _run(
        "exporting DCP",
        quiet,
        dry_run,
        lambda hooks: _exporters().export_dcp(
            store,
            out,
            world_size=world_size,
            layout="nested" if layout == "nested" else "flat",
            overwrite=overwrite,
            dry_run=dry_run,
            hooks=hooks,
        ),
    )


@interruptible(_interrupted)
def accelerate_command(
    store: Store,
    out: Out,
    world_size: Annotated[
        int | None,
        typer.Option(
            help="Ranks whose FSDP2 shards the files hold [default: the source's]; "
            "load_state reshards to any.",
            min=1,
        ),
    ] = None,
    index: Annotated[
        int, typer.Option(help="Write pytorch_model_fsdp_I/ and optimizer_I/.", min=0)
    ] = 0,
    overwrite: Overwrite = False,
    dry_run: DryRun = False,
    quiet: Quiet = False,
) -> None:
    """An Accelerate FSDP2 save_state folder that stock accelerator.load_state(OUT) resumes."""
    _run(
        "exporting Accelerate state",
        quiet,
        dry_run,
        lambda hooks: _exporters().export_accelerate(
            store,
            out,
            world_size=world_size,
            index=index,
            overwrite=overwrite,
            dry_run=dry_run,
            hooks=hooks,
        ),
    )


@interruptible(_interrupted)
def megatron_command(
    store: Store,
    out: Out,
    tp: Annotated[
        int, typer.Option("--tp", help="Tensor-parallel degree to resume at.", min=1)
    ] = 1,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline-parallel stages.", min=1)] = 1,
    ep: Annotated[int, typer.Option("--ep", help="Expert-parallel degree (MoE).", min=1)] = 1,
    distributed_optimizer: Annotated[
        bool | None,
        typer.Option(
            "--distributed-optimizer/--no-distributed-optimizer",
            help="Optimizer state for Megatron's distributed optimizer (fully_reshardable) or a "
            "non-distributed one [default: the source's].",
            show_default=False,
        ),
    ] = None,
    dtype: SourceDtype = None,
    first_stage_layers: Annotated[
        int | None,
        typer.Option(
            help="Layers of the first pipeline stage (uneven stages) [default: the source's "
            "at its own --pp, else even].",
            min=0,
        ),
    ] = None,
    last_stage_layers: Annotated[
        int | None,
        typer.Option(
            help="Layers of the last pipeline stage (uneven stages) [default: the source's "
            "at its own --pp, else even].",
            min=0,
        ),
    ] = None,
    vpp: Annotated[
        int | None,
        typer.Option(
            "--vpp",
            help="Virtual pipeline stages per pipeline rank [default: the source's at its own "
            "--pp, else 1].",
            min=1,
        ),
    ] = None,
    etp: Annotated[
        int | None,
        typer.Option(
            "--etp",
            help="The experts' tensor-parallel degree [default: the source's at its own TP and "
            "EP, else --tp].",
            min=1,
        ),
    ] = None,
    overwrite: Overwrite = False,
    dry_run: DryRun = False,
    quiet: Quiet = False,
) -> None:
    """A Megatron-Core torch_dist checkpoint (OUT/iter_N/, the tracker file) that Megatron-LM
    and stock dist_checkpointing.load resume at TP x PP x EP."""
    _run(
        "exporting Megatron-Core",
        quiet,
        dry_run,
        lambda hooks: _exporters().export_megatron(
            store,
            out,
            tp=tp,
            pp=pp,
            ep=ep,
            distributed_optimizer=distributed_optimizer,
            dtype=dtype,
            first_stage_layers=first_stage_layers,
            last_stage_layers=last_stage_layers,
            vpp=vpp,
            etp=etp,
            overwrite=overwrite,
            dry_run=dry_run,
            hooks=hooks,
        ),
    )


export_app.command("safetensors", cls=PlainCommand)(safetensors_command)
export_app.command("deepspeed-universal", cls=PlainCommand)(universal_command)
export_app.command("deepspeed", cls=PlainCommand)(deepspeed_command)
export_app.command("dcp", cls=PlainCommand)(dcp_command)
export_app.command("accelerate", cls=PlainCommand)(accelerate_command)
export_app.command("megatron", cls=PlainCommand)(megatron_command)
