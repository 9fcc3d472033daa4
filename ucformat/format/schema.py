"""Generate ``schemas/manifest.schema.json`` from the manifest models.

Run ``python -m ucformat.format.schema`` after changing :mod:`ucformat.format.models`; a test
fails when the
committed file and the models drift apart.
"""

from __future__ import annotations

import argparse
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
    """``python -m ucformat.format.schema [--check | --stdout | --output PATH]``.

    Without options, writes the checkout's ``schemas/manifest.schema.json`` (and only there: a
    stray argument is a usage error, never a file name).
    """
    parser = argparse.ArgumentParser(
        prog="python -m ucformat.format.schema",
        description="Generate the JSON schema of ucformat.json from the manifest models.",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--stdout", action="store_true", help="print the schema")
    group.add_argument(
        "--check", action="store_true", help="exit 1 if the committed schema is out of date"
    )
    group.add_argument(
        "--output", type=Path, metavar="PATH", help=f"write it there (default: {SCHEMA_PATH})"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    text = render_schema()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if args.check:
        current = SCHEMA_PATH.read_text() if SCHEMA_PATH.exists() else ""
        print("up to date" if current == text else f"{SCHEMA_PATH} is out of date")
        return 0 if current == text else 1
    target: Path = args.output or SCHEMA_PATH
    if args.output is None and not SCHEMA_PATH.parent.is_dir():
        parser.error(f"{SCHEMA_PATH.parent} does not exist (not a checkout); use --output PATH")
    target.write_text(text)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
