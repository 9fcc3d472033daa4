"""Ctrl-C outside every command body (imports, argument parsing) still gives one line and 130.

The commands' own interrupt messages are tested with real signals in
tests/integration/test_overwrite_safety.py; these cover the entry point around them.
"""

from __future__ import annotations

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
