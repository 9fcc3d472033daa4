"""Ctrl-C outside every command body: one line, and an exit code that tells the truth (130
during the imports or argument parsing; the command's own code once it has ended).

The commands' own interrupt messages are tested with real signals in
tests/integration/test_interrupts.py and tests/integration/test_overwrite_safety.py; these
cover the entry point around them.
"""

from __future__ import annotations

import contextlib

import pytest
import typer
import ucformat_cli._entry as entry
import ucformat_cli._errors as cli_errors
import ucformat_cli.main as cli_main


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """No arguments, and no command run yet in this "process"."""
    monkeypatch.setattr("sys.argv", ["ucformat"])
    monkeypatch.setattr(cli_errors, "_PHASE", [])
    monkeypatch.setattr(cli_errors, "_ENDED_WITH", [])
    monkeypatch.setattr(entry, "_ended", lambda: None)  # keep this process's own Ctrl-C


def _interrupting_app() -> typer.Typer:
    """A Typer app whose command is interrupted outside ucformat's wrappers (as while parsing)."""
    app = typer.Typer()

    @app.command()
    def parse() -> None:
        raise KeyboardInterrupt

    return app


def test_interrupt_while_typer_parses_says_nothing_was_written(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli_main, "app", _interrupting_app())
    with pytest.raises(SystemExit) as exit_info:
        entry.run()
    assert exit_info.value.code == 130  # Typer's own code for an escaped KeyboardInterrupt
    assert capsys.readouterr().err == (
        "interrupted before the command started; nothing was written.\n"
    )


def test_interrupt_during_the_imports_says_nothing_was_written(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(prog_name: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "app", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        entry.run()
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == (
        "interrupted before the command started; nothing was written.\n"
    )


def test_a_command_that_reported_its_interrupt_is_not_reported_twice(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    app = typer.Typer()

    @app.command()
    @cli_errors.user_errors
    def work() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "app", app)
    with pytest.raises(SystemExit) as exit_info:
        entry.run()
    assert exit_info.value.code == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize("how", ["typer", "after typer"])
def test_an_interrupt_after_the_command_succeeded_keeps_its_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    """Its work is done and its summary printed: a script checking $? sees success."""

    @cli_errors.user_errors
    def work() -> None:
        print("wrote the store")

    def app(prog_name: str) -> None:
        work()
        if how == "typer":  # landed while Typer was still finishing: it exits 130 silently
            raise SystemExit(130)
        raise KeyboardInterrupt  # landed on the way out

    monkeypatch.setattr(cli_main, "app", app)
    with pytest.raises(SystemExit) as exit_info:
        entry.run()
    assert exit_info.value.code == 0
    captured = capsys.readouterr()
    assert captured.out == "wrote the store\n"
    assert (
        captured.err == "interrupted after the command had ended; what it printed above stands.\n"
    )


def test_an_interrupt_after_a_failed_command_keeps_its_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    @cli_errors.user_errors
    def work() -> None:
        raise typer.Exit(code=1)  # verify: problems found

    def app(prog_name: str) -> None:
        with contextlib.suppress(typer.Exit):
            work()
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "app", app)
    with pytest.raises(SystemExit) as exit_info:
        entry.run()
    assert exit_info.value.code == 1
