"""Read, validate and commit the manifest (``ucformat.json``).

Commit protocol: every array is written first; the manifest is written last, as one object
(atomic rename on local disk, a single PUT on object stores). A store without a manifest is
incomplete by definition and every reader refuses it.

The manifest carries ``digest``: the sha256 of its canonical JSON (sorted keys, no whitespace)
with ``digest`` itself set to null, so an edited manifest is detected.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import ValidationError
from zarr.abc.store import Store

from ucformat.errors import IncompleteStoreError, ManifestError, UnsupportedVersionError
from ucformat.models import CheckpointManifest
from ucformat.spec import FORMAT_NAME, FORMAT_VERSION, MANIFEST_KEY
from ucformat.zarr_io import read_key, write_key

__all__ = ["commit_manifest", "manifest_digest", "parse_manifest", "read_manifest"]


def manifest_digest(manifest: CheckpointManifest) -> str:
    """sha256 (hex) of the canonical JSON of ``manifest`` with ``digest`` cleared."""
    data = manifest.model_copy(update={"digest": None}).model_dump(mode="json")
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def commit_manifest(store: Store, manifest: CheckpointManifest) -> CheckpointManifest:
    """Stamp ``manifest`` with its digest and write it as the store's last object."""
    stamped = manifest.model_copy(update={"digest": manifest_digest(manifest)})
    text = stamped.model_dump_json(indent=1)
    write_key(store, MANIFEST_KEY, text.encode())
    return stamped


def read_manifest(store: Store, where: str) -> CheckpointManifest:
    """Read and fully validate the manifest of ``store`` (``where`` names it in messages)."""
    payload = read_key(store, MANIFEST_KEY)
    if payload is None:
        raise IncompleteStoreError(
            f"{where}: no {MANIFEST_KEY}; this is not a complete ucformat store (a convert that "
            "was interrupted or is still running leaves it out). Re-run "
            "'ucformat convert ... --overwrite'."
        )
    return parse_manifest(payload, where)


def parse_manifest(payload: bytes, where: str) -> CheckpointManifest:
    """Validate manifest bytes: JSON, format name, version gate, schema, digest."""
    try:
        data: Any = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(
            f"{where}/{MANIFEST_KEY}: not valid JSON ({exc}); the manifest is damaged."
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ManifestError(
            f"{where}/{MANIFEST_KEY}: expected format '{FORMAT_NAME}', found {found!r}."
        )
    _check_version(str(data.get("format_version", "")), where)
    try:
        manifest = CheckpointManifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        location = ".".join(str(p) for p in first["loc"])
        raise ManifestError(
            f"{where}/{MANIFEST_KEY}: invalid manifest at '{location}': {first['msg']} "
            f"({exc.error_count()} error(s) in all)."
        ) from None
    if manifest.digest is not None and manifest.digest != manifest_digest(manifest):
        raise ManifestError(
            f"{where}/{MANIFEST_KEY}: digest mismatch; the manifest was edited after it was "
            "written. Restore it or re-run the convert."
        )
    return manifest


def _check_version(version: str, where: str) -> None:
    major, _, _ = version.partition(".")
    ours, _, _ = FORMAT_VERSION.partition(".")
    if not major.isdigit():
        raise ManifestError(f"{where}/{MANIFEST_KEY}: bad format_version {version!r}.")
    if int(major) > int(ours):
        raise UnsupportedVersionError(
            f"{where}: written in ucformat format {version}, but this ucformat reads format "
            f"{ours}.x; upgrade ucformat to read it."
        )
