"""The trainer recipes (docs/clients.md, docs/trainer.md, docs/torchtitan.md) name only commands,
options and API that exist: every ``ucformat ...`` line parses (it may fail on its example paths,
never on an unknown command or option), every Python block compiles, and every ``ucformat``
name it imports or uses resolves. The recipes themselves are run by the tests each section
names (real clients, torchrun)."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner
from ucformat_cli.main import app

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = ("clients.md", "trainer.md", "torchtitan.md")
_BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)


def _blocks(page: str, python: bool) -> list[str]:
    text = (DOCS / page).read_text()
    return [body for lang, body in _BLOCK.findall(text) if (lang == "python") == python]


def _commands(page: str) -> list[list[str]]:
    out = []
    for block in _blocks(page, python=False):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("ucformat "):
                out.append(shlex.split(line)[1:])
    return out


@pytest.mark.parametrize("page", PAGES)
def test_every_command_parses(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the example paths do not exist here: nothing is written
    commands = _commands(page)
    assert commands, page
    for args in commands:
        result = CliRunner().invoke(app, args)
        output = " ".join(result.output.split())
        for problem in ("No such option", "No such command", "Missing argument", "Got unexpected"):
            assert problem not in output, (args, output)


def _resolve(dotted: str) -> None:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            target = getattr(target, name)
        return
    raise AssertionError(f"{dotted}: no such module")


def _ucformat_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ucformat"):
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("ucformat"))
        elif isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "ucformat":
                names.add(".".join(["ucformat", *reversed(chain)]))
    return names


@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_compiles_and_names_real_api(page: str) -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    for block in _blocks(page, python=True):
        tree = ast.parse(block)
        compile(tree, page, "exec")
        for name in sorted(_ucformat_names(tree)):
            _resolve(name)
