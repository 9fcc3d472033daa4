"""docs/cli.md against the real command line: the synopsis, the defaults, the inspect example.

The commands and options are read from the Typer app itself (every command, however nested,
every option and the default its ``--help`` prints), so a command or option added without its
line in the synopsis, or a default changed in one place only, fails here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer.main
from ucformat_cli.main import app

import ucformat
from tests.cli.helpers import invoke

REPO = Path(__file__).resolve().parents[2]
CLI_MD = (REPO / "docs" / "cli.md").read_text()
_OPTION = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")
_DEFAULT = re.compile(r"\[default: ([^\]]*)\]")


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    if hasattr(command, "commands"):  # a group (Typer's own click)
        for name, sub in command.commands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield " ".join(path), command


def real_cli() -> dict[str, dict[str, str | None]]:
    """Command path -> {option name: the default its help prints, or None}."""
    found: dict[str, dict[str, str | None]] = {}
    for path, command in _commands(typer.main.get_command(app)):
        context = type(command).context_class(command, info_name=path)
        options: dict[str, str | None] = {}
        for param in command.params:
            if param.param_type_name != "option":
                continue
            record = param.get_help_record(context)
            defaults = _DEFAULT.findall(record[1]) if record else []
            default = defaults[-1].split("; ")[0] if defaults else None  # "1; x>=1": the default
            main = max(param.opts, key=len)  # --quiet of (-q, --quiet)
            for name in (*param.opts, *param.secondary_opts):
                options[name] = default if name == main else None
        found[path] = {name: default for name, default in options.items() if name != "--help"}
    return found


def _synopsis() -> dict[str, set[str]]:
    """Command path -> options, from the first code block of docs/cli.md."""
    block = CLI_MD.split("```\n", 2)[1]
    lines: list[str] = []
    for line in block.splitlines():
        if line.startswith("ucformat "):
            lines.append(line)
        elif line.startswith(" ") and lines:
            lines[-1] += " " + line.strip()
    commands: dict[str, set[str]] = {}
    for line in lines:
        words = line.split()[1:]
        path = []
        while words and re.fullmatch(r"[a-z][a-z-]*", words[0]):
            path.append(words.pop(0))
        if path:
            commands[" ".join(path)] = set(_OPTION.findall(" ".join(words)))
    return commands


def _defaults_table() -> dict[tuple[str, str], str]:
    rows = re.findall(r"^\| `([a-z -]+)` \| `(--?[\w-]+)` \| (.*?) \|$", CLI_MD, re.M)
    return {(command, option): default for command, option, default in rows}


def test_the_synopsis_lists_every_command_and_option() -> None:
    cli, documented = real_cli(), _synopsis()
    assert sorted(documented) == sorted(cli), "commands in docs/cli.md's synopsis vs the CLI"
    for command, options in cli.items():
        assert documented[command] == set(options), command


def test_the_defaults_table_says_what_help_prints() -> None:
    printed = {
        (command, option): default
        for command, options in real_cli().items()
        for option, default in options.items()
        if default is not None
    }
    assert _defaults_table() == printed


def test_every_option_with_a_value_shows_its_default_or_is_required() -> None:
    """An option that takes a value has a default in --help, unless unset means "not used"."""
    unset_means_unused = {
        ("convert", "--opaque-global"), ("inspect", "--param"), ("verify", "--against"),
        ("verify", "--opaque-global"), ("export deepspeed", "--tp-layout"),
        ("convert", "--head-dim"),
    }  # fmt: skip
    for path, command in _commands(typer.main.get_command(app)):
        for param in command.params:
            if param.param_type_name != "option" or param.is_flag or param.required:
                continue
            name = max(param.opts, key=len)
            if (path, name) in unset_means_unused:
                continue
            record = param.get_help_record(type(command).context_class(command, info_name=path))
            assert record is not None and _DEFAULT.search(record[1]), (path, name, record)


def test_the_inspect_example_is_what_inspect_prints(tmp_path: Path) -> None:
    source = REPO / "tests" / "fixtures" / "data" / "z2-fp32-dsadam-ftb-ws3" / "ckpt"
    store = tmp_path / "ckpt.ucf"
    ucformat.convert(source, store)
    example = CLI_MD.split("$ ucformat inspect ckpt.ucf\n", 1)[1].split("\n$ ", 1)[0]
    printed = invoke("inspect", store).stdout.replace(str(source), "/runs/gpt")
    assert printed.strip() == example.strip()
