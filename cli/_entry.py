"""The ``ucformat`` command's entry point: Ctrl-C at any moment gives one line and exit code 130.

A command's own wrapper (:func:`ucformat_cli._errors.interruptible`) says what an interrupt left
on disk. An interrupt outside every command body (during the imports, while Typer parses the
arguments, or after the command returned) is caught here; Typer would otherwise exit 130 in
silence, and Python print a traceback.
"""

from __future__ import annotations

import sys

#: Exit code of an interrupted command (128 + SIGINT), as shells report it.
INTERRUPTED = 130


def _phase() -> str:
    """The command's phase (:func:`ucformat_cli._errors.command_phase`); "" before it loaded."""
    errors = sys.modules.get("ucformat_cli._errors")
    return str(errors.command_phase()) if errors is not None else ""


def _outside_a_command(phase: str) -> str:
    if phase:
        return "interrupted after the command had ended; what it printed above stands."
    return "interrupted before the command started; nothing was written."


def run() -> None:
    """Run the ``ucformat`` Typer app (``[project.scripts]`` and ``python -m ucformat_cli``)."""
    try:
        from ucformat_cli.main import app

        app(prog_name="ucformat")
    except KeyboardInterrupt:  # during the imports, before Typer took over
        print(_outside_a_command(_phase()), file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED) from None
    except SystemExit as exc:
        phase = _phase()
        if exc.code == INTERRUPTED and phase != "interrupted":
            print(_outside_a_command(phase), file=sys.stderr, flush=True)
        raise
