"""The ``ucformat`` command's entry point: Ctrl-C at any moment gives one line and an exit code
that tells the truth.

A command's own wrapper (:func:`ucformat_cli._errors.interruptible`) says what an interrupt left
on disk (exit code 130, or 0 when its write had been committed). An interrupt outside every
command body is caught here: during the imports or while Typer parses the arguments (130:
nothing was written), or after the command returned (the command's own exit code: what it
printed stands). Typer would otherwise exit 130 in silence, and Python print a traceback.
"""

from __future__ import annotations

import signal
import sys

#: Exit code of an interrupted command (128 + SIGINT), as shells report it.
INTERRUPTED = 130


def _phase() -> str:
    """The command's phase (:func:`ucformat_cli._errors.command_phase`); "" before it loaded."""
    errors = sys.modules.get("ucformat_cli._errors")
    return str(errors.command_phase()) if errors is not None else ""


def _ended_with() -> int:
    """The exit code the finished command chose (:func:`ucformat_cli._errors.ended_with`)."""
    errors = sys.modules.get("ucformat_cli._errors")
    return int(errors.ended_with()) if errors is not None else 0


def _outside_a_command(phase: str) -> str:
    if phase:
        return "interrupted after the command had ended; what it printed above stands."
    return "interrupted before the command started; nothing was written."


def run() -> None:
    """Run the ``ucformat`` Typer app (``[project.scripts]`` and ``python -m ucformat_cli``)."""
    try:
        from ucformat_cli.main import app

        app(prog_name="ucformat")
    except KeyboardInterrupt:  # during the imports, before Typer took over, or after it
        _ended()
        phase = _phase()
        print(_outside_a_command(phase), file=sys.stderr, flush=True)
        raise SystemExit(_ended_with() if phase == "finished" else INTERRUPTED) from None
    except SystemExit as exc:
        _ended()
        phase = _phase()
        if exc.code == INTERRUPTED and phase != "interrupted":
            print(_outside_a_command(phase), file=sys.stderr, flush=True)
            if phase == "finished":  # its work is done: exit as it would have
                raise SystemExit(_ended_with()) from None
        raise


def _ended() -> None:
    """The command is over: a Ctrl-C while the interpreter shuts down (joining the writers'
    threads, flushing) must not turn its exit code into a death by SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
