"""``ucformat/store/`` is the only package that imports zarr, and it uses zarr's public API.

The one exception, named here with its reason, is ``zarr.core.sync`` (zarr 3.1 has no public
synchronous store API); docs/design.md says what a newer zarr would break.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ucformat"
STORE = PACKAGE / "store"
#: Private zarr modules the store package may use, each for a reason docs/design.md gives.
ALLOWED_PRIVATE = {"zarr.core.sync": {"keys.py"}}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names), wherever the import statement is."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _is_zarr(name: str) -> bool:
    return name == "zarr" or name.startswith(("zarr.", "numcodecs"))


def test_only_the_store_package_imports_zarr() -> None:
    outside = {
        str(path.relative_to(PACKAGE)): sorted(filter(_is_zarr, _imports(path)))
        for path in PACKAGE.rglob("*.py")
        if STORE not in path.parents
    }
    assert {path: names for path, names in outside.items() if names} == {}
    assert len(outside) > 30  # the walk found the package


def test_the_store_package_uses_public_zarr_modules() -> None:
    private = {}
    for path in STORE.rglob("*.py"):
        for name in filter(_is_zarr, _imports(path)):
            if name.startswith("zarr.core") and path.name not in ALLOWED_PRIVATE.get(name, ()):
                private.setdefault(str(path.relative_to(PACKAGE)), []).append(name)
    assert private == {}
