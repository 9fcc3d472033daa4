"""The committed JSON schema is exactly what the models generate, and validates real manifests."""

from __future__ import annotations

import json

import jsonschema

from tests.helpers import tiny_manifest
from ucformat.format.schema import SCHEMA_PATH, render_schema


def test_committed_schema_matches_models() -> None:
    assert SCHEMA_PATH.read_text() == render_schema(), (
        "schemas/manifest.schema.json is stale: run `python -m ucformat.format.schema`"
    )


def test_schema_validates_a_manifest() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.validate(json.loads(tiny_manifest().model_dump_json()), schema)
