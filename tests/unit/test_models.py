"""Manifest models: strictness, references, and the digest."""

from __future__ import annotations

import json
import typing

import pytest
from pydantic import ValidationError

from tests.helpers import tiny_manifest
from ucformat.errors import ManifestError, UnsupportedVersionError
from ucformat.format.dtypes import DTYPE_NAMES
from ucformat.format.models import CheckpointManifest, DTypeName
from ucformat.store.manifest_io import manifest_digest, parse_manifest


def test_dtype_literal_matches_dtype_table() -> None:
    assert set(typing.get_args(DTypeName)) == set(DTYPE_NAMES)


def test_round_trip_json() -> None:
    manifest = tiny_manifest()
    again = CheckpointManifest.model_validate_json(manifest.model_dump_json())
    assert again == manifest
    assert again.resolve("lm_head.weight") == "emb.weight"


def test_unknown_keys_are_refused() -> None:
    data = tiny_manifest().model_dump(mode="json")
    data["params"]["emb.weight"]["surprise"] = 1
    with pytest.raises(ValidationError, match="surprise"):
        CheckpointManifest.model_validate(data)


def test_dangling_references_are_refused() -> None:
    data = tiny_manifest().model_dump(mode="json")
    data["tied"] = {"x": "missing.weight"}
    with pytest.raises(ValidationError, match="tied alias 'x' points to unknown param"):
        CheckpointManifest.model_validate(data)
    data = tiny_manifest().model_dump(mode="json")
    data["optimizer"]["groups"][0]["params"].append("ghost")
    with pytest.raises(ValidationError, match="optimizer group 0 lists unknown param 'ghost'"):
        CheckpointManifest.model_validate(data)


def payload(manifest: CheckpointManifest) -> bytes:
    stamped = manifest.model_copy(update={"digest": manifest_digest(manifest)})
    return stamped.model_dump_json().encode()


def test_parse_accepts_stamped_manifest() -> None:
    manifest = tiny_manifest()
    assert parse_manifest(payload(manifest), "s").params == manifest.params


def test_edited_manifest_is_caught_by_digest() -> None:
    data = json.loads(payload(tiny_manifest()))
    data["progress"]["global_steps"] = 999
    with pytest.raises(ManifestError, match="digest mismatch; the manifest was edited"):
        parse_manifest(json.dumps(data).encode(), "s")


def test_newer_major_version_is_refused_with_both_versions() -> None:
    data = json.loads(payload(tiny_manifest()))
    data["format_version"] = "4.0"
    data["new_field"] = {}
    with pytest.raises(
        UnsupportedVersionError, match=r"format 4\.0, but this ucformat reads format 3\.x"
    ):
        parse_manifest(json.dumps(data).encode(), "s")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"format": "other"}', "expected format 'ucformat', found 'other'"),
        (b"[]", "expected format 'ucformat', found 'list'"),
    ],
)
def test_damaged_manifest_messages(raw: bytes, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        parse_manifest(raw, "s")
