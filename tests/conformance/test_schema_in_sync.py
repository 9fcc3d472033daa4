"""The committed JSON schema is exactly what the models generate, and validates real manifests."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema

from tests.helpers import tiny_manifest
from ucformat.format.schema import SCHEMA_PATH, render_schema

REPO = Path(__file__).resolve().parents[2]


def test_committed_schema_matches_models() -> None:
    assert SCHEMA_PATH.read_text() == render_schema(), (
        "schemas/manifest.schema.json is stale: run `python -m ucformat.format.schema`"
    )


def test_schema_validates_a_manifest() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.validate(json.loads(tiny_manifest().model_dump_json()), schema)


def test_the_wheel_ships_the_schema(tmp_path: Path) -> None:
    """``pip wheel`` of the checkout holds ``ucformat/format/manifest.schema.json``, the same
    bytes as ``schemas/manifest.schema.json`` (the package file is a link to it)."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("ucformat-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packaged = archive.read("ucformat/format/manifest.schema.json")
    assert packaged == SCHEMA_PATH.read_bytes()
