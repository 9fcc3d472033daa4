"""Turn user-caused errors into one-line messages and exit code 2."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from ucformat.errors import UCFormatError

P = ParamSpec("P")
R = TypeVar("R")

#: Exit code for errors the user can fix (bad path, damaged input, refused overwrite, ...).
USER_ERROR = 2

stderr = Console(stderr=True, highlight=False, soft_wrap=True)

#: Where the running command is: "running", "finished" or "interrupted" (empty: not started).
_PHASE: list[str] = []
#: The exit code the command ended with (for an interrupt that lands after it ended).
_ENDED_WITH: list[int] = []


@dataclass(frozen=True)
class Left:
    """What an interrupted command left on disk: the line to print, and whether its write had
    been committed (the command then exits 0: its work is done, only its last lines may be
    missing)."""

    said: str
    committed: bool = False


def left_at(where: str, dry_run: bool, committed: str, uncommitted: str) -> Left:
    """What an interrupted write left at ``where``, read from the disk (docs/format.md §6.2):
    the local destination's own state, or for a URL the ``committed`` line when this process
    had committed and the ``uncommitted`` one otherwise."""
    from ucformat.store.destination import left_on_disk, was_committed
    from ucformat.store.locations import local_directory

    if dry_run:
        return Left("nothing was written.")
    done = was_committed(where)
    if local_directory(where) is not None:
        return Left(f"{left_on_disk(where)}.", done)
    return Left(committed, True) if done else Left(uncommitted)


def command_phase() -> str:
    """Where the command is: "", "running", "finished" or "interrupted" (for the entry point)."""
    return _PHASE[-1] if _PHASE else ""


def ended_with() -> int:
    """The exit code of the command that finished (0 if it has not said otherwise)."""
    return _ENDED_WITH[-1] if _ENDED_WITH else 0


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` on stderr and return the exit to raise."""
    stderr.print(f"[bold red]error:[/] {escape(message)}", markup=True)
    _ENDED_WITH.append(USER_ERROR)
    return typer.Exit(code=USER_ERROR)


def user_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Decorate a command: UCFormatError/OSError -> one line on stderr, exit code 2."""
    return interruptible(None)(command)


def interruptible(
    on_interrupt: Callable[[dict[str, object]], Left] | None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """:func:`user_errors`, and Ctrl-C -> one line saying what is left on disk
    (``on_interrupt(kwargs)``, read from the disk): exit code 130, or 0 when the write had
    been committed before the interrupt landed."""

    def decorate(command: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(command)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            _PHASE.append("running")
            try:
                return command(*args, **kwargs)
            except UCFormatError as exc:  # the library names its keyword; the CLI its option
                raise fail(exc.message.replace("overwrite=True", "--overwrite")) from None
            except OSError as exc:
                where = f"{exc.filename}: " if exc.filename else ""
                raise fail(f"{where}{exc.strerror or exc}") from None
            except MemoryError:
                raise fail(
                    "out of memory: the request needs more memory than this machine has; "
                    "read less at a time (e.g. a slice or one parameter)."
                ) from None
            except typer.Exit as exc:  # the command's own exit code (verify's 1)
                _ENDED_WITH.append(exc.exit_code)
                raise
            except KeyboardInterrupt:
                left = on_interrupt(dict(kwargs)) if on_interrupt is not None else Left("")
                if left.committed:
                    _PHASE.append("finished")
                    stderr.print(f"interrupted after the commit: {left.said}", markup=False)
                    raise typer.Exit(code=0) from None
                _PHASE.append("interrupted")
                said = left.said
                stderr.print(f"interrupted: {said}" if said else "interrupted", markup=False)
                raise typer.Exit(code=130) from None
            finally:
                if _PHASE[-1] == "running":
                    _PHASE.append("finished")

        return wrapper

    return decorate
