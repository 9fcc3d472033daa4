"""``ucformat inspect STORE``: metadata at a glance; reads no tensor data."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ucformat.format.expert_summary import group_experts
from ucformat.format.summary import format_bytes, summarize
from ucformat.store.manifest_io import load_manifest

from ._errors import user_errors
from ._table import render_table


@user_errors
def inspect_command(
    store: Annotated[str, typer.Argument(help="A ucformat store: path or fsspec URL.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
    param: Annotated[str | None, typer.Option(help="Only params matching this glob.")] = None,
) -> None:
    """Show what a store holds: params, shapes, dtypes, groups, states, sizes."""
    manifest = load_manifest(store)
    if as_json:
        typer.echo(manifest.model_dump_json(indent=2))
        return
    summary = summarize(manifest)
    if not param:
        summary = group_experts(summary, manifest)  # MoE: one row per layer and expert param
    console = Console(highlight=False, soft_wrap=True)
    for key, value in summary.header.items():
        console.print(f"[bold]{key}:[/] {escape(str(value))}")
    params = [
        (
            row.name + (f" (= {', '.join(row.aliases)})" if row.aliases else ""),
            _shape(row.shape),
            row.dtype,
            row.group,
            ", ".join(row.states),
            format_bytes(row.nbytes),
        )
        for row in summary.params
        if not param or fnmatch.fnmatchcase(row.name, param)
    ]
    columns: tuple[str, ...] = ("name", "shape", "dtype", "group", "states", "size")
    typer.echo(render_table("parameters", columns, params, right_aligned=frozenset({"size"})))
    if summary.groups:
        per_partition = summary.partition_states  # format 3.1: states kept once per partition
        groups: list[tuple[str, ...]] = [
            (str(index), str(count), hyper)
            + ((per_partition.get(index, "-"),) if per_partition else ())
            for index, count, hyper in summary.groups
        ]
        columns = ("group", "params", "hyper-parameters")
        if per_partition:
            columns = (*columns, "states per ZeRO partition")
        typer.echo("\n" + render_table("optimizer groups", columns, groups))
    if summary.buffers:
        buffers = [(name, _shape(shape), dtype) for name, shape, dtype in summary.buffers]
        typer.echo("\n" + render_table("buffers", ("name", "shape", "dtype"), buffers))
    for key, value in summary.totals.items():
        console.print(f"[bold]{key}:[/] {escape(str(value))}")


def _shape(shape: Sequence[int]) -> str:
    """``16x8``; ``()`` for a scalar."""
    return "x".join(map(str, shape)) or "()"
