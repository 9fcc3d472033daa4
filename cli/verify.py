"""``ucformat verify STORE [--against SRC]``: every checksum, every object, the manifest digest."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ._errors import user_errors

#: Exit code when verification ran and found problems (2 is for unusable input).
PROBLEMS_FOUND = 1


@user_errors
def verify_command(
    store: Annotated[str, typer.Argument(help="A ucformat store: path or fsspec URL.")],
    against: Annotated[
        str | None,
        typer.Option(
            help="The checkpoint it was converted from (DeepSpeed, DCP/FSDP2, Megatron-Core, a "
            "client's folder): compare every value with it."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    keep_going: Annotated[
        bool,
        typer.Option(
            "--keep-going",
            help="Check the arrays even when the manifest's digest is missing or wrong.",
        ),
    ] = False,
    opaque_global: Annotated[
        list[str] | None,
        typer.Option(help="Pickle global the convert needed --opaque-global for. Repeatable."),
    ] = None,
    no_check_source: Annotated[
        bool,
        typer.Option(
            "--no-check-source",
            help="With --against: skip the CRC-32 check of the source files' tensor bytes.",
        ),
    ] = False,
) -> None:
    """Check a store: manifest digest, metadata, every shard and chunk checksum; exit 0 if all hold.

    With --against, also re-read the source checkpoint and require every value to be bit-equal.
    Exit codes: 0 all good, 1 problems found (each printed), 2 unusable input.
    """
    from ucformat.verify import verify

    report = verify(
        store,
        against,
        opaque_globals=opaque_global or (),
        check_source=not no_check_source,
        keep_going=keep_going,
    )
    if as_json:
        typer.echo(json.dumps(report.as_dict(), indent=2))
    else:
        for problem in report.problems:
            typer.echo(str(problem))
        typer.echo(report.summary())
    if not report.ok:
        raise typer.Exit(code=PROBLEMS_FOUND)
