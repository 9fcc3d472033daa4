"""``ucformat inspect STORE``: metadata at a glance; reads no tensor data."""

from __future__ import annotations

import fnmatch
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from ucformat_cli._errors import user_errors

import ucformat
from ucformat.summary import format_bytes, summarize


@user_errors
def inspect_command(
    store: Annotated[str, typer.Argument(help="A ucformat store: path or fsspec URL.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON.")] = False,
    param: Annotated[str | None, typer.Option(help="Only params matching this glob.")] = None,
) -> None:
    """Show what a store holds: params, shapes, dtypes, groups, states, sizes."""
    ckpt = ucformat.open(store)
    if as_json:
        typer.echo(ckpt.manifest.model_dump_json(indent=2))
        return
    summary = summarize(ckpt.manifest)
    console = Console(highlight=False, soft_wrap=True)
    for key, value in summary.header.items():
        console.print(f"[bold]{key}:[/] {value}")
    table = Table(title="parameters", title_justify="left")
    for column in ("name", "shape", "dtype", "group", "states", "size"):
        table.add_column(column, justify="right" if column == "size" else "left")
    for row in summary.params:
        if param and not fnmatch.fnmatchcase(row.name, param):
            continue
        name = row.name + (f" (= {', '.join(row.aliases)})" if row.aliases else "")
        table.add_row(
            name, "x".join(map(str, row.shape)) or "()", row.dtype, row.group,
            ", ".join(row.states), format_bytes(row.nbytes),
        )  # fmt: skip
    console.print(table)
    if summary.groups:
        groups = Table(title="optimizer groups", title_justify="left")
        for column in ("group", "params", "hyper-parameters"):
            groups.add_column(column)
        for index, count, hyper in summary.groups:
            groups.add_row(str(index), str(count), hyper)
        console.print(groups)
    if summary.buffers:
        buffers = Table(title="buffers", title_justify="left")
        for column in ("name", "shape", "dtype"):
            buffers.add_column(column)
        for name, shape, dtype in summary.buffers:
            buffers.add_row(name, "x".join(map(str, shape)) or "()", dtype)
        console.print(buffers)
    for key, value in summary.totals.items():
        console.print(f"[bold]{key}:[/] {value}")
