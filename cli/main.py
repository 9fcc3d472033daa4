"""Root of the ``ucformat`` Typer app."""

from __future__ import annotations

from typing import Annotated

import typer

from ucformat import __version__

from ._plain import PlainCommand, PlainGroup
from .convert import convert_command
from .export import export_app
from .inspect import inspect_command
from .verify import verify_command

app = typer.Typer(
    name="ucformat",
    help="Universal checkpoints for DeepSpeed ZeRO, Megatron-Core, PyTorch DCP/FSDP2 and the "
    "trainers built on them (HF Trainer, Accelerate, Lightning, torchtitan): convert, inspect, "
    "verify, export.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help (defaults shown) and one-line usage errors
    cls=PlainGroup,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ucformat {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Universal checkpoints for DeepSpeed ZeRO, Megatron-Core, PyTorch DCP/FSDP2 and the
    trainers built on them."""


app.command("convert", cls=PlainCommand)(convert_command)
app.command("inspect", cls=PlainCommand)(inspect_command)
app.command("verify", cls=PlainCommand)(verify_command)
app.add_typer(export_app, name="export")

if __name__ == "__main__":
    app()
