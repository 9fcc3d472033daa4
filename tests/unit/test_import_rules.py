"""The package floors of docs/design.md hold: no import runs up a floor, no two modules import
each other.

Imports are read from the source (``ast``), at any depth (function-level imports count);
imports under ``if TYPE_CHECKING:`` are annotations only and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ucformat"

#: The floors, lowest first: a package may import its own modules and any lower floor's.
FLOORS: tuple[frozenset[str], ...] = (
    frozenset({"errors", "_version"}),
    frozenset({"format", "layout", "sysio"}),
    frozenset({"sources", "store", "collective"}),
    frozenset({"read", "write"}),
    frozenset({"verify", "export", "deepspeed", "torch", "megatron"}),
    frozenset({"lightning", "transformers"}),  # trainer bindings over deepspeed/ and torch/
    frozenset({"", "__main__"}),  # ucformat/__init__.py: the public API; python -m ucformat
)


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _floor_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _floor(module: str) -> int:
    package = _floor_package(module)
    for index, floor in enumerate(FLOORS):
        if package in floor:
            return index
    raise AssertionError(f"{module}: package {package!r} is on no floor; add it to FLOORS")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "ucformat":
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "ucformat")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    return {
        _module(path): _imports(ast.parse(path.read_text(), str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


GRAPH = _graph()


def test_every_package_is_on_a_floor() -> None:
    for module in GRAPH:
        _floor(module)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_runs_up_a_floor(module: str) -> None:
    own = _floor_package(module)
    upward = [
        target
        for target in sorted(GRAPH[module])
        if _floor_package(target) != own and _floor(target) >= _floor(module)
    ]
    assert not upward, f"{module} imports {upward}: same or higher floor (see docs/design.md)"


def test_no_two_modules_import_each_other() -> None:
    mutual = sorted(
        (a, b) for a, targets in GRAPH.items() for b in targets if a < b and a in GRAPH.get(b, ())
    )
    assert not mutual, f"modules importing each other: {mutual}"


def test_the_rule_sees_a_violation() -> None:
    """The checker itself: an upward import and a cycle are found."""
    tree = ast.parse("from ucformat.torch.load import load\nimport ucformat.format.spec\n")
    assert _imports(tree) == {"ucformat.torch.load", "ucformat.format.spec"}
    guarded = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ucformat.x\n"
    )
    assert _imports(guarded) == set()
    assert _floor("ucformat.torch.load") > _floor("ucformat.store.keys")
