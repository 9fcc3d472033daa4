"""Shared fixtures: the DeepSpeed checkpoint grid, generated once per machine and cached."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.s3server import S3Server

REPO = Path(__file__).resolve().parents[1]
#: Generated DeepSpeed checkpoints live here between sessions (git-ignored).
GRID_CACHE = Path(os.environ.get("UCFORMAT_GRID_CACHE", REPO / "tests" / ".cache" / "ds_grid"))
# DeepSpeed JIT-builds its CPU ops here, in this checkout, for in-process imports and every
# launch alike (a folder shared with other virtualenvs is rebuilt by each and keeps stale locks).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "tests" / ".cache" / "torch_extensions"))


def deepspeed_available() -> bool:
    """Whether DeepSpeed is importable (it is a test dependency, optional for users)."""
    return importlib.util.find_spec("deepspeed") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked ``gpu`` where no CUDA device is available (they are collected
    everywhere, so their count shows in every run)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is false)")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def ds_grid() -> Path:
    """Every case of tests.fixtures.ds_cases.ALL and ZOO, made by DeepSpeed itself (cached; one
    launch per world size for both)."""
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    from tests.fixtures.ds_cases import ALL, ZOO
    from tests.fixtures.make_fixtures import generate

    generate(GRID_CACHE, ALL + ZOO, verbose=True)
    return GRID_CACHE


@pytest.fixture(scope="session")
def ds_loads(ds_grid: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Results of every load case (tests/fixtures/load_cases.py), run once per session."""
    from tests.fixtures.load_cases import ALL_LOADS
    from tests.fixtures.run_loads import run_loads

    return run_loads(ALL_LOADS, ds_grid, tmp_path_factory.mktemp("loads"))


def s3_available() -> bool:
    """Whether the S3 test dependencies (s3fs, moto's server) are installed."""
    return all(importlib.util.find_spec(name) is not None for name in ("s3fs", "moto", "flask"))


#: The bucket every S3 test writes into (on the tests' own server).
S3_BUCKET = "ucformat-tests"


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 (a free port), with bucket ``S3_BUCKET``, for the session.

    Its endpoint and dummy credentials are put into ``os.environ`` (botocore's own settings:
    ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), so this process and every process it
    starts (torchrun jobs, CLI runs) reach it through s3fs with no other configuration; they
    are restored, and the server stopped, at the end.
    """
    if not s3_available():
        pytest.skip("s3fs / moto[server] are not installed (pip install -e '.[test]')")
    from tests.s3server import S3Server

    recording = tmp_path_factory.mktemp("s3") / "requests.jsonl"
    with S3Server(recording=recording) as server:
        server.create_bucket(S3_BUCKET)
        saved = {key: os.environ.get(key) for key in server.env()}
        os.environ.update(server.env())
        try:
            yield server
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
