"""Shared fixtures: the DeepSpeed checkpoint grid, generated once per machine and cached."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Generated DeepSpeed checkpoints live here between sessions (git-ignored).
GRID_CACHE = Path(os.environ.get("UCFORMAT_GRID_CACHE", REPO / "tests" / ".cache" / "ds_grid"))


def deepspeed_available() -> bool:
    """Whether DeepSpeed is importable (it is a test dependency, optional for users)."""
    return importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="session")
def ds_grid() -> Path:
    """Every case of tests.fixtures.ds_cases.ALL, made by DeepSpeed itself (cached)."""
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    from tests.fixtures.ds_cases import ALL
    from tests.fixtures.make_fixtures import generate

    generate(GRID_CACHE, ALL, verbose=True)
    return GRID_CACHE


@pytest.fixture(scope="session")
def ds_loads(ds_grid: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Results of every load case (tests/fixtures/load_cases.py), run once per session."""
    from tests.fixtures.load_cases import ALL_LOADS
    from tests.fixtures.run_loads import run_loads

    return run_loads(ALL_LOADS, ds_grid, tmp_path_factory.mktemp("loads"))
