"""Plain ``--help`` for every command: readable metavars (``SRC``, ``N``, ``TEXT``), no Rich boxes;
usage errors in one ``error:`` line (exit code 2).

Typer names a parameter's metavar after its Python type (``<str>``, ``{src}``); this command
class names each argument after itself and each option after its type, as click's own help does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer.core

__all__ = ["PlainCommand", "PlainGroup"]

#: click's ``UsageError`` (Typer vendors click; this names it without a private import).
_USAGE_ERROR: type[Exception] = next(
    kind for kind in typer.BadParameter.__mro__ if kind.__name__ == "UsageError"
)

_BY_TYPE: dict[object, str] = {int: "N", float: "X", Path: "PATH"}


def _one_line(error: Any, command: str, more: str = "") -> None:
    """Make a click usage error print ``error: <message>[ more] (see 'ucformat ... --help')``."""

    def show(file: Any = None) -> None:
        said = f"{error.format_message()} {more}".strip()
        typer.echo(f"error: {said} (see '{command} --help')", err=True)

    error.show = show


class PlainGroup(typer.core.TyperGroup):
    """A Typer group whose usage errors (a mistyped or missing command) are one line that lists
    the commands."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """Parse the group's own options; a usage error says itself in one line."""
        try:
            return super().parse_args(ctx, args)
        except _USAGE_ERROR as error:
            _one_line(error, ctx.command_path)
            raise

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        """Find the command; an unknown one is one line naming the commands there are."""
        try:
            return super().resolve_command(ctx, args)
        except _USAGE_ERROR as error:
            commands = ", ".join(self.list_commands(ctx))
            _one_line(error, ctx.command_path, f"The commands are: {commands}.")
            raise


class PlainCommand(typer.core.TyperCommand):
    """A Typer command whose parameters all carry an explicit, readable metavar, and whose
    usage errors are one line."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """Parse; a usage error says itself in one line."""
        try:
            return super().parse_args(ctx, args)
        except _USAGE_ERROR as error:
            _one_line(error, ctx.command_path)
            raise

    def invoke(self, ctx: Any) -> Any:
        """Run; a ``BadParameter`` raised by the command body is one line too."""
        try:
            return super().invoke(ctx)
        except _USAGE_ERROR as error:
            _one_line(error, ctx.command_path)
            raise

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.metavar is not None:
                continue
            if param.param_type_name == "argument":
                name = (param.name or "arg").upper()
                param.metavar = name
                # Typer shows "{src} <str>"; say "SRC" (click's own convention) in both places
                vars(param)["display_name_raw"] = name
                vars(param)["display_type_rich"] = lambda ctx: ""
                usage = name if param.required else f"[{name}]"
                vars(param)["_usage_display_name"] = lambda usage=usage: usage
            elif not getattr(param, "is_flag", False):
                kind = getattr(getattr(param, "type_descriptor", None), "annotation", None)
                param.metavar = _BY_TYPE.get(kind, "TEXT")
