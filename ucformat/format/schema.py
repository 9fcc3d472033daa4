"""Generate ``schemas/manifest.schema.json`` from the manifest models.

Run ``python -m ucformat.format.schema`` after changing :mod:`ucformat.format.models`; a test
fails when the
committed file and the models drift apart.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ucformat.format.models import CheckpointManifest
from ucformat.format.spec import FORMAT_VERSION

__all__ = ["SCHEMA_PATH", "manifest_json_schema", "render_schema"]

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "manifest.schema.json"


def manifest_json_schema() -> dict[str, Any]:
    """The JSON schema (2020-12) of ``ucformat.json``."""
    schema = CheckpointManifest.model_json_schema(mode="serialization")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://ucformat.dev/schemas/manifest-{FORMAT_VERSION}.schema.json",
        **schema,
    }


def render_schema() -> str:
    """The schema as committed: indented JSON with a trailing newline."""
    return json.dumps(manifest_json_schema(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the schema to ``schemas/manifest.schema.json`` (or the path given)."""
    args = sys.argv[1:] if argv is None else argv
    target = Path(args[0]) if args else SCHEMA_PATH
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_schema())
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
