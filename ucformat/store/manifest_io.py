"""Read, validate and commit the manifest (``ucformat.json``).

Commit protocol: every array is written first; the manifest is written last, as one object
(atomic rename on local disk, a single PUT on object stores). A store without a manifest is
incomplete by definition and every reader refuses it.

The manifest carries ``digest``: the sha256 of its canonical JSON with ``digest`` itself set to
null, so an edited manifest is detected; a manifest without one is refused too. Format 2 uses
RFC 8785 (:mod:`ucformat.format.jcs`); format 1 stores keep format 1's rule (Python's ``json.dumps``
with sorted keys), so they stay readable (docs/format.md §3.7).
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
from ucformat.format.base import IGNORE_UNKNOWN
from ucformat.format.jcs import FloatCensus, canonicalize, parse
from ucformat.format.models import CheckpointManifest
from ucformat.format.spec import FORMAT_NAME, FORMAT_VERSION, KNOWN_MINOR, MANIFEST_KEY
from ucformat.store.durable import sync_tree, write_file_atomic
from ucformat.store.locations import existing_store_directory, local_directory
from ucformat.sysio.collector import collection_paused

if TYPE_CHECKING:
    from zarr.abc.store import Store

    from ucformat.store.keys import StoreLike

#: Reads one object of a store by key; None when it is absent.
KeyReader = Callable[[str], "bytes | None"]

__all__ = [
    "ROOT_KEY",
    "MAX_JSON_DEPTH",
    "MAX_MANIFEST_BYTES",
    "commit_manifest",
    "digest_matches",
    "document_digest",
    "is_newer_minor",
    "load_manifest",
    "manifest_digest",
    "parse_manifest",
    "read_manifest",
    "read_manifest_bytes",
]

#: The largest manifest a reader accepts (docs/format.md §3.8), checked before it is read.
MAX_MANIFEST_BYTES = 64 * 2**20
#: The deepest JSON nesting a manifest may have (§3.8), checked before it is parsed.
MAX_JSON_DEPTH = 200

#: The root group's metadata object: written first, so its presence marks a started convert.
ROOT_KEY = "zarr.json"


def manifest_digest(manifest: CheckpointManifest) -> str:
    """``sha256:<hex>`` of ``manifest`` with ``digest`` cleared, by its version's rule (§3.7):
    computed, as a reader computes it, on the JSON the manifest is written as."""
    with collection_paused():  # as in parse_manifest: many objects, no cycles
        document, census = parse(manifest.model_dump_json().encode())
        return document_digest(document, census)


def document_digest(document: Mapping[str, Any], census: FloatCensus | None = None) -> str:
    """The digest of a manifest as stored: its parsed JSON object, ``digest`` cleared (§3.7);
    ``census``: the document's float census where :func:`ucformat.format.jcs.parse` read it
    (the same digest, faster).

    Computed on the stored document, not on a re-serialised model, so members a reader does not
    know (a newer minor version) are digested too, and a reader that knows optional fields with
    defaults the writer did not have computes the writer's digest. Format 2 and later: SHA-256
    of the RFC 8785 canonical form; format 1: of Python's ``json.dumps(sort_keys=True,
    separators=(",", ":"))`` (ASCII escapes).

    Raises:
        ManifestError: the document has no canonical form (a non-finite number, an integer
            beyond ±(2**53 - 1), a lone surrogate).
    """
    body = {**document, "digest": None}
    major = _major(document.get("format_version"))
    try:
        if major == 1:
            canonical = json.dumps(
                body, sort_keys=True, separators=(",", ":"), allow_nan=False
            ).encode()
        else:
            canonical = canonicalize(body, census)
    except ValueError as exc:  # CanonicalizationError is one
        raise ManifestError(
            f"the manifest has no canonical JSON form, so no digest ({exc}); a writer must not "
            "write such values."
        ) from None
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def _major(version: object) -> int | None:
    major = str(version).partition(".")[0]
    return int(major) if major.isdigit() else None


def commit_manifest(
    store: Store,
    manifest: CheckpointManifest,
    *,
    durable: bool = True,
    objects_synced: bool = False,
    digest: str | None = None,
) -> CheckpointManifest:
    """Stamp ``manifest`` with its digest and write it as the store's last object.

    On a local directory store with ``durable`` (docs/format.md §6), every file and directory
    already in the store is fsynced first, then the manifest is written to a temporary file,
    fsynced, renamed into place and the root directory fsynced: once this returns, a power loss
    cannot leave a committed manifest whose shards were lost. Other stores get one ``set``.
    ``objects_synced``: the writers have already made every object and directory of the store
    durable (:func:`ucformat.store.durable.sync_written`, a distributed write, §6), so only
    the manifest's own steps remain. ``digest``: :func:`manifest_digest` of ``manifest``, when
    the writer computed it beforehand (while its shards were written).
    A staged local store's manifest is written into its staging folder and the folder swapped
    onto its destination, one step that Ctrl-C cannot split
    (:meth:`~ucformat.store.destination.LocalDestination.commit`); the previous store, if any,
    is then removed and the destination's writer lock released (docs/format.md §6).
    """
    from ucformat.store.destination import mark_committed
    from ucformat.store.direct.objects import local_file
    from ucformat.store.keys import describe_store, store_writes, write_key
    from ucformat.store.staged_local import StagedLocalStore
    from ucformat.store.write_session import release_writer

    if digest is None:
        digest = manifest_digest(manifest)
    stamped = manifest.model_copy(update={"digest": digest})
    payload = stamped.model_dump_json(indent=1).encode()
    if isinstance(store, StagedLocalStore):  # the commit point of a local store: the swap
        local = store.staged
        local.fsync = durable
        try:
            with store_writes(store, f"committing {MANIFEST_KEY}"):
                local.commit(
                    seal=lambda folder: write_file_atomic(
                        folder / MANIFEST_KEY, payload, fsync=durable
                    ),
                    synced=objects_synced,
                )
        except BaseException:
            if local.state != "committed":  # not committed: the previous store stays
                local.discard()
            raise
        store.root = local.path
        return stamped
    path = local_file(store, MANIFEST_KEY) if durable else None
    try:
        if path is None:
            write_key(store, MANIFEST_KEY, payload)
        else:
            with store_writes(store, f"writing {MANIFEST_KEY}"):
                if not objects_synced:
                    sync_tree(path.parent)
                write_file_atomic(path, payload, fsync=True)
        mark_committed(describe_store(store))
    finally:
        release_writer(store)
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
        path = directory / key
        try:
            _check_size(path.stat().st_size, str(directory))  # before reading it
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    return read


def read_manifest_bytes(store: Store, where: str) -> bytes:
    """The manifest object of ``store``; the errors of :func:`read_manifest` when absent."""
    from ucformat.store.direct.objects import local_file
    from ucformat.store.keys import read_key

    def read(key: str) -> bytes | None:
        # Local stores: a stat first, so a huge object is refused unread; object stores are
        # checked after the one GET (a HEAD would cost every open a round trip), before parsing.
        path = local_file(store, key)
        if path is not None:
            try:
                _check_size(path.stat().st_size, where)
            except FileNotFoundError:
                return None
        data = read_key(store, key)
        if data is not None:
            _check_size(len(data), where)
        return data

    return _read_manifest_payload(read, where)


def _check_size(size: int, where: str) -> None:
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{where}/{MANIFEST_KEY}: {size} bytes, more than the {MAX_MANIFEST_BYTES} a "
            "manifest may have (docs/format.md §3.8); it is damaged or not a ucformat manifest."
        )


def _check_depth(payload: bytes, where: str) -> None:
    """Refuse JSON nested deeper than :data:`MAX_JSON_DEPTH`, before parsing it."""
    opening = payload.count(b"[") + payload.count(b"{")
    if opening <= MAX_JSON_DEPTH:
        return
    import numpy as np

    # Without escaped backslashes, then escaped quotes, every '"' opens or closes a string,
    # and a bracket nests where an even number of them precede it.
    text = payload.replace(b"\\\\", b"").replace(b'\\"', b"")
    kinds = np.zeros(256, dtype=np.int8)  # per byte: 2 a quote, 1 opens, -1 closes, 0 other
    kinds[ord('"')] = 2
    kinds[[ord("["), ord("{")]] = 1
    kinds[[ord("]"), ord("}")]] = -1
    codes = np.frombuffer(text, dtype=np.uint8)
    depth = level = quotes = 0
    for start in range(0, codes.size, 1 << 22):  # bounded memory: 4 MiB at a time
        block = kinds[codes[start : start + (1 << 22)]]
        marks = block[np.flatnonzero(block)]  # the quotes and brackets, in order
        is_quote = marks == 2
        seen = np.cumsum(is_quote, dtype=np.int64) + quotes
        steps = np.where(is_quote | (seen % 2 == 1), 0, marks).astype(np.int64)
        running = np.cumsum(steps) + level
        depth = max(depth, int(running.max(initial=level)))
        level = int(running[-1]) if running.size else level
        quotes = int(seen[-1]) if seen.size else quotes
    if depth > MAX_JSON_DEPTH:
        raise ManifestError(
            f"{where}/{MANIFEST_KEY}: JSON nested {depth} levels deep, more than the "
            f"{MAX_JSON_DEPTH} a manifest may have (docs/format.md §3.8); it is damaged or "
            "hostile."
        )


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
    _check_size(len(payload), where)
    _check_depth(payload, where)
    with collection_paused():  # millions of acyclic objects: no collections while they grow
        return _parse_checked(payload, where, check_digest)


def _parse_checked(payload: bytes, where: str, check_digest: bool) -> CheckpointManifest:
    try:
        data, census = parse(payload)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ManifestError(
            f"{where}/{MANIFEST_KEY}: not valid JSON ({exc}); the manifest is damaged."
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ManifestError(
            f"{where}/{MANIFEST_KEY}: expected format '{FORMAT_NAME}', found {found!r}."
        )
    newer_minor = _check_version(str(data.get("format_version", "")), where)
    try:
        manifest = CheckpointManifest.model_validate(
            data, context=IGNORE_UNKNOWN if newer_minor else None
        )
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
    if check_digest and not _digest_matches(data, where, census):
        raise ManifestError(
            f"{where}/{MANIFEST_KEY}: digest mismatch; the manifest was edited after it was "
            "written. Restore it or re-run the convert."
        )
    return manifest


def digest_matches(document: Mapping[str, Any], census: FloatCensus | None = None) -> bool:
    """Whether a parsed manifest's ``digest`` is present and equals :func:`document_digest`
    (``census`` as there).

    Raises:
        ManifestError: the document has no canonical form.
    """
    if document.get("digest") is None:
        return False
    return bool(document["digest"] == document_digest(document, census))


def _digest_matches(document: Mapping[str, Any], where: str, census: FloatCensus | None) -> bool:
    try:
        return digest_matches(document, census)
    except ManifestError as exc:
        raise ManifestError(f"{where}/{MANIFEST_KEY}: {exc}") from None


def is_newer_minor(version: str) -> bool:
    """Whether ``version`` (of a readable major) is newer than the minor this reader knows."""
    major, _, minor = version.partition(".")
    known = KNOWN_MINOR.get(int(major)) if major.isdigit() else None
    return known is not None and minor.isdigit() and int(minor) > known


def _check_version(version: str, where: str) -> bool:
    """Refuse a version this reader cannot read; True for a newer minor of a known major."""
    major, dot, minor = version.partition(".")
    if not (major.isdigit() and dot and minor.isdigit()):
        raise ManifestError(
            f"{where}/{MANIFEST_KEY}: bad format_version {version!r}; expected 'MAJOR.MINOR'."
        )
    newest = max(KNOWN_MINOR)
    if int(major) > newest:
        raise UnsupportedVersionError(
            f"{where}: written in ucformat format {version}, but this ucformat reads format "
            f"{newest}.x at most (it writes {FORMAT_VERSION}); upgrade ucformat to read it."
        )
    known = KNOWN_MINOR.get(int(major))
    if known is None:
        raise UnsupportedVersionError(
            f"{where}: format_version {version} is not a ucformat format version; this ucformat "
            f"reads formats {', '.join(f'{m}.x' for m in sorted(KNOWN_MINOR))}."
        )
    return is_newer_minor(version)
