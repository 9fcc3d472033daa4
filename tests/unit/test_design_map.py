"""docs/design.md against the source: its module map and every module or function it names.

* every row of the module map names a module (or folder) that exists, once;
* every module under ``ucformat/`` has a row (package ``__init__.py`` files excepted);
* every name written ``<module path>.<name>`` anywhere in the document
  (``write/execute.write_units``, ``collective.settle``, ``ucformat.deepspeed.load``,
  ``read/checkpoint.UniversalCheckpoint.read_runs``) is defined there: a function, class,
  method or constant, read from the source (``ast``).
  A bare ``word.name`` whose first word is neither a module path, the public API, a class of the
  package nor one of the few outside names below fails too (``writer.write_units``).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "ucformat"
DESIGN = (REPO / "docs" / "design.md").read_text()

#: First words of backticked dotted names that are not ucformat's: other libraries, manifest
#: sections, file names.
OUTSIDE = frozenset(
    {"torch", "os", "dcp", "zarr", "deepspeed", "accelerator", "source", "progress", "moe1"}
)
FILE_SUFFIXES = frozenset({"json", "pt", "py", "md", "metadata", "pkl", "safetensors"})
_ROW = re.compile(r"^\| `((?:ucformat|cli)/[^`]*)`", re.M)
_DOTTED = re.compile(r"`([A-Za-z_][\w/]*(?:\.[A-Za-z_]\w*)+)`")


def _rows() -> list[str]:
    return _ROW.findall(DESIGN)


@functools.cache
def _names(path: Path) -> dict[str, set[str]]:
    """Top-level names of a module -> the names defined in each (class members; {} otherwise)."""
    tree = ast.parse(path.read_text())
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members: set[str] = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets if isinstance(t, ast.Name))
            found[node.name] = members
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found[node.name] = set()
        elif isinstance(node, ast.Assign):
            found.update((t.id, set()) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = set()
        elif isinstance(node, ast.ImportFrom | ast.Import):
            found.update((a.asname or a.name.split(".")[0], set()) for a in node.names)
    return found


def _module_file(dotted: str) -> Path | None:
    """``write/execute`` or ``ucformat.deepspeed`` -> its source file, or None."""
    parts = dotted.replace(".", "/").removeprefix("ucformat/").split("/")
    base = PACKAGE.joinpath(*parts) if parts != ["ucformat"] else PACKAGE
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _classes() -> set[str]:
    return {
        name
        for path in PACKAGE.rglob("*.py")
        for name, members in _names(path).items()
        if name[:1].isupper()
    }


def _lazy_public() -> set[str]:
    """What ``ucformat.<name>`` answers (ucformat/__init__.py's lazy tables)."""
    source = (PACKAGE / "__init__.py").read_text()
    return set(re.findall(r'^    "(\w+)": \("ucformat', source, re.M)) | set(
        re.findall(r'"(\w+)"', source.split("_LAZY_SUBMODULES = frozenset(", 1)[1].split(")")[0])
    )


def _problem(token: str) -> str | None:
    """Why the dotted name ``token`` does not resolve, or None."""
    head, *rest = token.split(".")
    if rest and rest[-1] in FILE_SUFFIXES and len(rest) == 1:
        return None  # a file name: zarr.json, common.pt
    if "/" in head or head in ("collective", "errors"):
        module = _module_file(head)
        if module is None:
            return f"no module ucformat/{head}.py"
        return _attributes(module, rest, token)
    if head == "ucformat":
        if rest[0] not in _lazy_public():
            return f"ucformat has no public name {rest[0]!r}"
        if len(rest) > 1:  # ucformat.deepspeed.load: the subpackage's own names
            module = _module_file(f"ucformat.{rest[0]}")
            assert module is not None
            return _attributes(module, rest[1:], token)
        return None
    if head[:1].isupper():
        return None if head in _classes() else f"no class {head} in ucformat"
    if head in OUTSIDE:
        return None
    return f"{head!r} is no ucformat module: write the module's path (write/execute.write_units)"


def _attributes(module: Path, rest: list[str], token: str) -> str | None:
    names = _names(module)
    if rest[0] not in names:
        return f"{module.relative_to(REPO)} defines no {rest[0]!r}"
    if len(rest) > 1 and rest[1] not in names[rest[0]]:
        return f"{rest[0]} in {module.relative_to(REPO)} has no member {rest[1]!r}"
    return None


def test_every_row_names_a_module_that_exists_once() -> None:
    rows = _rows()
    assert len(rows) > 100, "the module map's rows were not found"
    missing = [row for row in rows if not (REPO / row).exists()]
    assert missing == [], f"rows naming nothing: {missing}"
    repeated = sorted({row for row in rows if rows.count(row) > 1})
    assert repeated == [], f"rows that repeat: {repeated}"


def test_every_module_has_a_row() -> None:
    rows = set(_rows())
    modules = sorted(
        path.relative_to(REPO).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" or path.parent == PACKAGE
    )
    assert [module for module in modules if module not in rows] == []


def test_every_named_function_or_module_exists() -> None:
    problems = {
        token: problem
        for token in sorted(set(_DOTTED.findall(DESIGN)))
        if (problem := _problem(token)) is not None
    }
    assert problems == {}


def test_the_check_catches_what_the_old_map_said() -> None:
    assert _problem("writer.write_units") is not None
    assert _problem("layout/dtensor.aligned_chunking") is not None
    assert _problem("write/execute.write_units") is None
    assert _problem("read/checkpoint.UniversalCheckpoint.read_runs") is None
