"""Read, validate and commit the manifest (``ucformat.json``).

Commit protocol: every array is written first; the manifest is written last, as one object
(atomic rename on local disk, a single PUT on object stores). A store without a manifest is
incomplete by definition and every reader refuses it.

The manifest carries ``digest``: the sha256 of its canonical JSON (sorted keys, no whitespace)
with ``digest`` itself set to null, so an edited manifest is detected; a manifest without one
is refused too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ucformat.errors import (
    IncompleteStoreError,
    ManifestError,
    NotAStoreError,
    UnsupportedVersionError,
)
from ucformat.models import CheckpointManifest
from ucformat.spec import FORMAT_NAME, FORMAT_VERSION, MANIFEST_KEY
from ucformat.store.locations import existing_store_directory, local_directory

if TYPE_CHECKING:
    from zarr.abc.store import Store

    from ucformat.store.keys import StoreLike

#: Reads one object of a store by key; None when it is absent.
KeyReader = Callable[[str], "bytes | None"]

__all__ = [
    "ROOT_KEY",
    "commit_manifest",
    "digest_matches",
    "document_digest",
    "load_manifest",
    "manifest_digest",
    "parse_manifest",
    "read_manifest",
    "read_manifest_bytes",
]

#: The root group's metadata object: written first, so its presence marks a started convert.
ROOT_KEY = "zarr.json"


def manifest_digest(manifest: CheckpointManifest) -> str:
    """sha256 (hex) of the canonical JSON of ``manifest`` with ``digest`` cleared."""
    return document_digest(manifest.model_dump(mode="json"))


def document_digest(document: Mapping[str, Any]) -> str:
    """The digest of a manifest as stored: its parsed JSON object, ``digest`` cleared (§3.7).

    Computed on the stored document, not on a re-serialised model, so that a reader that knows
    optional fields with defaults the writer did not have computes the writer's digest.
    """
    canonical = json.dumps(
        {**document, "digest": None}, sort_keys=True, separators=(",", ":"), allow_nan=False
    )
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def commit_manifest(store: Store, manifest: CheckpointManifest) -> CheckpointManifest:
    """Stamp ``manifest`` with its digest and write it as the store's last object."""
    from ucformat.store.keys import write_key

    stamped = manifest.model_copy(update={"digest": manifest_digest(manifest)})
    text = stamped.model_dump_json(indent=1)
    write_key(store, MANIFEST_KEY, text.encode())
    return stamped


def read_manifest(store: Store, where: str) -> CheckpointManifest:
    """Read and fully validate the manifest of ``store`` (``where`` names it in messages).

    Raises:
        NotAStoreError: neither a manifest nor a ucformat root group is there.
        IncompleteStoreError: the root group exists but the manifest does not (a convert was
            interrupted or is still running).
        ManifestError: the manifest is damaged, invalid or edited (see :func:`parse_manifest`).
    """
    return parse_manifest(read_manifest_bytes(store, where), where)


def load_manifest(target: StoreLike) -> CheckpointManifest:
    """The validated manifest of the store at ``target``, reading nothing else.

    What ``ucformat inspect`` uses: a local store is read with plain file I/O, so neither zarr nor
    torch is imported; any other target goes through its zarr store. The errors are those of
    :func:`read_manifest`, and of :func:`ucformat.store.keys.open_store` for a bad path.
    """
    path = local_directory(target) if isinstance(target, (str, Path)) else None
    if path is None:
        from ucformat.store.keys import open_store

        return read_manifest(open_store(target, read_only=True), str(target))
    directory = existing_store_directory(path)
    where = str(target)
    return parse_manifest(_read_manifest_payload(_file_reader(directory), where), where)


def _file_reader(directory: Path) -> KeyReader:
    def read(key: str) -> bytes | None:
        try:
            return (directory / key).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            return None

    return read


def read_manifest_bytes(store: Store, where: str) -> bytes:
    """The manifest object of ``store``; the errors of :func:`read_manifest` when absent."""
    from ucformat.store.keys import read_key

    return _read_manifest_payload(lambda key: read_key(store, key), where)


def _read_manifest_payload(read: KeyReader, where: str) -> bytes:
    payload = read(MANIFEST_KEY)
    if payload is not None:
        return payload
    root = read(ROOT_KEY)
    if root is None:
        raise NotAStoreError(
            f"{where}: not a ucformat store (no {MANIFEST_KEY} and no {ROOT_KEY}); give the path "
            "of a store written by 'ucformat convert'."
        )
    if not _is_ucformat_root(root):
        raise NotAStoreError(
            f"{where}: a zarr store, but not a ucformat one (its {ROOT_KEY} has no "
            f"'{FORMAT_NAME}' attribute and there is no {MANIFEST_KEY})."
        )
    raise IncompleteStoreError(
        f"{where}: incomplete ucformat store: {ROOT_KEY} is there but {MANIFEST_KEY} is not, so "
        "the convert that wrote it was interrupted or is still running. Re-run "
        "'ucformat convert ... --overwrite'."
    )


def _is_ucformat_root(payload: bytes) -> bool:
    try:
        document = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return True  # damaged, but written by a convert: call it incomplete
    attributes = document.get("attributes") if isinstance(document, dict) else None
    return isinstance(attributes, dict) and FORMAT_NAME in attributes


def parse_manifest(payload: bytes, where: str, *, check_digest: bool = True) -> CheckpointManifest:
    """Validate manifest bytes: JSON, format name, version gate, schema, digest.

    Args:
        payload: the manifest bytes.
        where: names the store in messages.
        check_digest: refuse a manifest whose digest does not match (``verify`` turns this off
            to report the mismatch and still check the arrays).
    """
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
    if check_digest and manifest.digest is None:
        raise ManifestError(
            f"{where}/{MANIFEST_KEY}: carries no digest; ucformat writes one with every manifest, "
            "so it was edited or written by another tool. Re-run the convert."
        )
    if check_digest and not digest_matches(data):
        raise ManifestError(
            f"{where}/{MANIFEST_KEY}: digest mismatch; the manifest was edited after it was "
            "written. Restore it or re-run the convert."
        )
    return manifest


def digest_matches(document: Mapping[str, Any]) -> bool:
    """Whether a parsed manifest's ``digest`` is present and equals :func:`document_digest`."""
    return document.get("digest") is not None and document["digest"] == document_digest(document)


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
