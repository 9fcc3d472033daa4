"""``ucformat.verify``: prove that a store holds what its manifest promises, bit for bit.

Checks, in this order (docs/format.md, "Integrity"):

1. the manifest: JSON, schema and version gate, then its digest (a mismatch is reported, and
   the arrays are still checked against what it says); every array reference is consistent
   (path, shape, ``nbytes``, flat-contiguous chunk and shard shapes);
2. the root group's ``zarr.json`` and every stored array's ``zarr.json`` (a stack holding
   several logical arrays is one zarr array: docs/format.md §2.5), field by field, against the
   document the manifest implies (readers build arrays from the manifest, so the data is
   checked even when a ``zarr.json`` is damaged);
3. every shard object exists, and every chunk decodes with its crc32c verified. A shard is read
   whole (bounded memory: one shard at a time); when it fails, its chunks are read one by one so
   that each bad chunk is named by grid coordinates and flat element range;
4. with ``against``: the source checkpoint is re-planned in the store's layout, the manifest
   fields that come from the source must be equal, and each shard must equal, bit for bit, the
   source fragments that fill it (each source byte read once).

Problems are collected, not raised: the caller gets a :class:`VerifyReport`. Only a target that
cannot be verified at all (no such path, not a ucformat store, an incomplete store, a newer
format, an unreadable source) raises :class:`~ucformat.errors.UCFormatError`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ucformat.errors import (
    ChunkMissingError,
    CorruptDataError,
    ManifestError,
    UnsupportedVersionError,
)
from ucformat.format.dtypes import numpy_storage_dtype
from ucformat.format.jcs import FloatCensus
from ucformat.format.jcs import parse as parse_json
from ucformat.format.models import CheckpointManifest
from ucformat.format.spec import FORMAT_NAME, MANIFEST_KEY
from ucformat.format.stacks import StoredArray, stored_array
from ucformat.format.summary import format_bytes
from ucformat.layout.chunking import is_flat_chunking
from ucformat.layout.grid import chunk_box, chunk_flat_range, chunks_in_box, shard_grid
from ucformat.store.arrays import (
    Array,
    BadChunk,
    array_from_manifest,
    bad_chunks,
    chunk_key,
    expected_metadata,
    read_box,
)
from ucformat.store.checked import CheckedStore
from ucformat.store.direct.runs_read import read_runs
from ucformat.store.keys import Store, StoreLike, list_keys, open_store, read_key
from ucformat.store.locations import local_source
from ucformat.store.manifest_io import (
    ROOT_KEY,
    digest_matches,
    is_newer_minor,
    parse_manifest,
    read_manifest_bytes,
)
from ucformat.verify.checks import (
    ManifestArray,
    bit_differences,
    document_differences,
    manifest_arrays,
    manifest_differences,
    ref_problems,
)
from ucformat.verify.source import SourceShards, replan_source

__all__ = ["Problem", "VerifyReport", "verify"]

#: At most this many field differences are reported per document.
MAX_DIFFERENCES = 10


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a store.

    Attributes:
        kind: ``manifest``, ``metadata`` (a ``zarr.json``), ``missing`` (an object is absent),
            ``checksum`` (a chunk fails its crc32c or cannot be decoded), ``mismatch`` (values
            differ from the source) or ``source`` (a manifest field differs from the source).
        path: the stored array's path (a stack: the message names the logical arrays it
            concerns), or the store key (``ucformat.json``, ``zarr.json``).
        message: what is wrong, one line.
        chunk: grid coordinates of the chunk (or shard, for a missing object) concerned, in
            the stored array.
        elements: the flat element range ``[start, stop)`` concerned, in the stored array.
    """

    kind: str
    path: str
    message: str
    chunk: tuple[int, ...] | None = None
    elements: tuple[int, int] | None = None

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass
class VerifyReport:
    """What :func:`verify` checked and what it found."""

    store: str
    against: str | None = None
    #: Arrays whose data was checked (their metadata matched the manifest).
    arrays: int = 0
    shards: int = 0
    chunks: int = 0
    #: Uncompressed bytes decoded and checked.
    nbytes: int = 0
    #: Stored bytes read (metadata, indexes and chunks).
    bytes_read: int = 0
    #: Bytes of source values compared with the store (``against`` only).
    source_bytes: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems

    def add(self, kind: str, path: str, message: str, **where: Any) -> None:
        """Record one problem."""
        self.problems.append(Problem(kind, path, message, **where))

    def summary(self) -> str:
        """The one-line summary ``ucformat verify`` prints last."""
        counts = (
            f"{self.arrays} arrays, {self.shards} shards, {self.chunks} chunks, "
            f"{format_bytes(self.nbytes)} checked ({format_bytes(self.bytes_read)} read)"
        )
        if self.against is not None:
            counts += f", {format_bytes(self.source_bytes)} compared with {self.against}"
        if self.ok:
            return f"ok: {self.store}: {counts}"
        return f"FAILED: {self.store}: {len(self.problems)} problem(s); {counts}"

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: every field, plus ``ok`` and ``summary``."""
        return {**dataclasses.asdict(self), "ok": self.ok, "summary": self.summary()}


def verify(
    store: StoreLike,
    against: str | Path | None = None,
    *,
    opaque_globals: Iterable[str] = (),
    check_source: bool = True,
    keep_going: bool = False,
) -> VerifyReport:
    """Check every byte of a ucformat store, optionally against its source checkpoint.

    Args:
        store: a local path, an fsspec URL, or a zarr ``Store``.
        against: the checkpoint the store was converted from (DeepSpeed tag folder, or run folder
            holding the store's tag; or a DCP folder read with the default key layout); each
            array is compared with it bit for bit.
        opaque_globals: pickle globals the convert needed ``--opaque-global`` for.
        check_source: with ``against``, compare every source tensor storage read with its
            file's zip CRC-32; a damaged source file is an error (it cannot be the reference).
        keep_going: check the arrays even when the manifest's digest is missing or does not
            match (by default verify stops there: an edited manifest's shapes are not to be
            trusted with the time and memory a check takes).

    Returns:
        The report; ``report.ok`` is True only if every check holds.

    Raises:
        SourceNotFoundError: ``store`` does not exist.
        NotAStoreError: ``store`` is not a ucformat store.
        IncompleteStoreError: ``store`` has no committed manifest.
        UnsupportedVersionError: ``store`` is from a newer format major version.
        SourceChecksumError: a file of ``against`` fails its zip CRC-32.
        UCFormatError: ``against`` cannot be read.

    Example:
        >>> report = ucformat.verify("ckpt.ucf", against="runs/gpt/step800")  # doctest: +SKIP
        >>> report.ok, report.summary()  # doctest: +SKIP
        (True, 'ok: ckpt.ucf: 20 arrays, 23 shards, 50 chunks, 2.8 KiB checked (3.9 KiB ...')
    """
    where = str(store)
    checked = CheckedStore(open_store(store, read_only=True))
    report = VerifyReport(store=where, against=None if against is None else str(against))
    payload = read_manifest_bytes(checked, where)
    try:
        manifest = parse_manifest(payload, where, check_digest=False)
    except UnsupportedVersionError:
        raise
    except ManifestError as exc:
        report.add("manifest", MANIFEST_KEY, exc.message.removeprefix(f"{where}/{MANIFEST_KEY}: "))
        return report
    arrays = _check_manifest(manifest, *parse_json(payload), report)
    if report.problems and not keep_going:
        report.add(
            "manifest",
            MANIFEST_KEY,
            "arrays not checked: the manifest cannot be trusted (pass keep_going=True, or "
            "--keep-going, to check them anyway)",
        )
        return report
    lenient = is_newer_minor(manifest.format_version)  # zarr.json may hold newer members too
    _check_root(checked, manifest, report, lenient)
    keys = set(list_keys(checked))
    with ExitStack() as stack:
        source = None
        if against is not None:
            source = stack.enter_context(
                replan_source(local_source(against), manifest, arrays, opaque_globals, check_source)
            )
            foreign = _foreign_source(manifest, source.plan.manifest, against)
            differences = [] if foreign else manifest_differences(manifest, source.plan.manifest)
            differences.sort(key=lambda d: not d.startswith("'source."))  # provenance first
            if foreign is not None:  # another checkpoint: one line, not every field of both
                report.add("source", MANIFEST_KEY, foreign)
                source = None  # the store's own checks still run
            for message in differences[:MAX_DIFFERENCES]:
                report.add("source", MANIFEST_KEY, message)
            if len(differences) > MAX_DIFFERENCES:
                report.add(
                    "source",
                    MANIFEST_KEY,
                    f"... and {len(differences) - MAX_DIFFERENCES} more field differences "
                    "(see --json for all of them)",
                )
        for stored, names in _stored_arrays(arrays):
            _check_array(checked, stored, names, keys, source, report, lenient)
        if source is not None:
            source.check_integrity()
    report.bytes_read = checked.stats.bytes_read
    return report


def _stored_arrays(arrays: list[ManifestArray]) -> list[tuple[StoredArray, list[str]]]:
    """The stored arrays holding ``arrays``, each once, with the names of the logical arrays
    at each of its leading indices (a stack) or of the one it holds."""
    found: dict[str, tuple[StoredArray, list[str]]] = {}
    for array in arrays:
        stored = stored_array(array.ref)
        slot = array.ref.stack
        entry = found.setdefault(stored.path, (stored, [""] * (1 if slot is None else slot.size)))
        entry[1][0 if slot is None else slot.index] = array.expected_path
    return list(found.values())


def _foreign_source(
    stored: CheckpointManifest, planned: CheckpointManifest, against: str | Path
) -> str | None:
    """One line if the source holds other parameters than the store, else None."""
    mine, theirs = set(stored.params), set(planned.params)
    if mine == theirs:
        return None
    only_store, only_source = sorted(mine - theirs), sorted(theirs - mine)
    example = (only_store or only_source)[0]
    side = "the store" if only_store else "the source"
    return (
        f"{against} is not the checkpoint this store was converted from: "
        f"{len(only_source)} of its {len(theirs)} parameters are not in the store and "
        f"{len(only_store)} of the store's {len(mine)} are not in it (e.g. '{example}' only in "
        f"{side}); its values were not compared."
    )


def _check_manifest(
    manifest: CheckpointManifest,
    document: dict[str, Any],
    census: FloatCensus | None,
    report: VerifyReport,
) -> list[ManifestArray]:
    """Check the digest and every array reference; return the arrays fit to be checked."""
    if manifest.digest is None:
        report.add("manifest", MANIFEST_KEY, "carries no digest, so edits cannot be detected")
    elif not digest_matches(document, census):
        report.add("manifest", MANIFEST_KEY, "digest mismatch: edited after it was written")
    arrays, seen = [], set[str]()
    flat_only = int(manifest.format_version.partition(".")[0]) < 3
    listed = manifest_arrays(manifest)
    for array in listed:
        problems = ref_problems(array, seen)
        for message in problems:
            report.add("manifest", MANIFEST_KEY, message)
        ref = array.ref
        if flat_only and not problems and not is_flat_chunking(ref.shape, ref.chunk_shape):
            report.add(
                "manifest",
                MANIFEST_KEY,
                f"{array.what}: chunk shape {ref.chunk_shape} is a box, which format "
                f"{manifest.format_version} does not allow (§2.2); a store with box chunks "
                "must say format 3.0, or readers of format 2 misread it",
            )
        if problems:
            report.add("manifest", array.ref.path, "its chunks were not checked")
        else:
            arrays.append(array)
    unsound = {array.ref.path for array in listed} - {array.ref.path for array in arrays}
    return [array for array in arrays if array.ref.path not in unsound]  # whole stacks only


def _check_root(
    store: Store, manifest: CheckpointManifest, report: VerifyReport, lenient: bool
) -> None:
    document = _load_json(store, ROOT_KEY, ROOT_KEY, report)
    if document is None:
        return
    expected = {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": {
            FORMAT_NAME: {"format_version": manifest.format_version, "manifest": MANIFEST_KEY}
        },
    }
    found = {key: document.get(key) for key in expected} if isinstance(document, dict) else None
    differences = document_differences(found, expected, unknown_ok=lenient)
    for difference in list(differences)[:MAX_DIFFERENCES]:
        report.add("metadata", ROOT_KEY, difference.describe(ROOT_KEY, "the manifest"))


def _load_json(store: Store, key: str, path: str, report: VerifyReport) -> Any:
    """The parsed JSON object at ``key``; a problem about ``path`` if absent or unparsable."""
    payload = read_key(store, key)
    name = key.rpartition("/")[2]
    if payload is None:
        report.add("missing", path, f"{name} is missing")
        return None
    try:
        return json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        report.add("metadata", path, f"{name} is not valid JSON ({exc})")
        return None


def _check_array(
    store: Store,
    ref: StoredArray,
    names: list[str],
    keys: set[str],
    source: SourceShards | None,
    report: VerifyReport,
    lenient: bool,
) -> None:
    """Check one stored array's ``zarr.json``, then every shard (data is read as readers do);
    ``names``: the logical arrays at its leading indices (a stack), or the one it is."""
    document = _load_json(store, f"{ref.path}/{ROOT_KEY}", ref.path, report)
    if document is not None:
        found = list(document_differences(document, expected_metadata(ref), unknown_ok=lenient))
        for difference in found[:MAX_DIFFERENCES]:
            report.add("metadata", ref.path, difference.describe("zarr.json", "the manifest"))
    # readers build the array from the digest-checked manifest, not from its zarr.json
    array = array_from_manifest(store, ref)
    planned = source.arrays.get(ref.path) if source is not None else None
    compare = source if planned is not None and planned == ref else None
    report.arrays += len(names)
    holds = _Holds(ref, names)
    for coords in shard_grid(ref.shape, ref.shard_shape):
        _check_shard(array, ref, coords, keys, compare, report, holds)


@dataclass(frozen=True)
class _Holds:
    """Which logical arrays a part of a stored array holds, for messages (nothing for an array
    that is one logical array: its path names it)."""

    ref: StoredArray
    names: list[str]

    def of_chunk(self, coords: tuple[int, ...]) -> str:
        """`` of <name>`` for the chunk at ``coords`` of a stack, else ``""``."""
        if self.ref.separator == "/" or not coords:
            return ""
        return f" of {self.names[coords[0]]}"

    def of_elements(self, start: int, stop: int) -> str:
        """`` (<names>)``: the logical arrays of a stack holding flat ``[start, stop)``."""
        if self.ref.separator == "/" or start >= stop:
            return ""
        inner = math.prod(self.ref.shape[1:])
        first, last = start // max(inner, 1), (stop - 1) // max(inner, 1)
        held = self.names[first : last + 1]
        text = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        return f" ({text})"


def _check_shard(
    array: Array,
    ref: StoredArray,
    coords: tuple[int, ...],
    keys: set[str],
    source: SourceShards | None,
    report: VerifyReport,
    holds: _Holds,
) -> None:
    """The shard exists, each chunk decodes (crc32c), and its values equal the source's."""
    region = chunk_box(ref.shape, ref.shard_shape, coords)
    start, stop = chunk_flat_range(ref.shape, ref.shard_shape, coords)
    chunks = list(chunks_in_box(ref.shape, ref.chunk_shape, region))
    shard_key = chunk_key(array, coords)
    if shard_key not in keys:
        report.add(
            "missing", ref.path,
            f"shard object '{shard_key}' is missing: {_chunk_span(chunks)}, elements "
            f"[{start}, {stop}){holds.of_elements(start, stop)} are lost",
            chunk=coords, elements=(start, stop),
        )  # fmt: skip
        return
    try:
        values = _read_shard(array, ref, region, start, stop)
    except (CorruptDataError, ChunkMissingError) as exc:
        bad = _bad_chunks(array, region)
        for chunk in bad:
            report.add(
                "checksum", ref.path,
                f"{chunk.describe()}{holds.of_chunk(chunk.coords)} {chunk.reason}",
                chunk=chunk.coords, elements=(chunk.start, chunk.stop),
            )  # fmt: skip
        if not bad:  # the shard fails as a whole, yet no chunk alone does
            report.add(
                "checksum", ref.path,
                f"shard object '{shard_key}' (elements [{start}, {stop})"
                f"{holds.of_elements(start, stop)}) fails: {exc}",
                chunk=coords, elements=(start, stop),
            )  # fmt: skip
        return
    report.shards += 1
    report.chunks += len(chunks)
    report.nbytes += values.nbytes
    if source is not None:
        _compare_shard(ref, values, source.expected(ref.path, start), start, report, holds)


def _read_shard(
    array: Array, ref: StoredArray, region: tuple[slice, ...], start: int, stop: int
) -> np.ndarray:
    """The shard's values, flat, every chunk checked: by the readers' fast path when it can,
    else (or when anything does not check out) through zarr, which names the failing chunk."""
    values = np.empty(stop - start, dtype=numpy_storage_dtype(ref.dtype))
    store = array.store_path.store
    key = functools.partial(chunk_key, array)
    direct = read_runs(store, ref, key, [(start, stop, 0)], values)
    if direct.ok:
        return values
    values = read_box(array, region).reshape(-1)
    if direct.corrupt:  # damage zarr's decoder does not see (an absent chunk reads as zeros)
        raise direct.error(ref.path)
    return values


def _bad_chunks(array: Array, region: tuple[slice, ...]) -> list[BadChunk]:
    try:
        return list(bad_chunks(array, region))
    except ChunkMissingError:  # deleted while we were reading it
        return []


def _compare_shard(
    ref: StoredArray,
    values: np.ndarray,
    expected: np.ndarray | None,
    start: int,
    report: VerifyReport,
    holds: _Holds,
) -> None:
    if expected is None:
        report.add("mismatch", ref.path, f"the source has no values for elements from {start}")
        return
    report.source_bytes += expected.nbytes
    differing = bit_differences(values, expected)
    if differing.size:
        first, last = start + int(differing[0]), start + int(differing[-1]) + 1
        report.add(
            "mismatch", ref.path,
            f"{differing.size} of {expected.size} values in elements [{first}, {last})"
            f"{holds.of_elements(first, last)} differ "
            f"from the source (first: element {first} is {values[differing[0]].item()!r} in the "
            f"store, {expected[differing[0]].item()!r} in the source)",
            elements=(first, last),
        )  # fmt: skip


def _chunk_span(chunks: list[tuple[int, ...]]) -> str:
    def text(coords: tuple[int, ...]) -> str:
        return "(" + ", ".join(map(str, coords)) + ")"

    if len(chunks) == 1:
        return f"chunk {text(chunks[0])}"
    return f"chunks {text(chunks[0])} to {text(chunks[-1])}"
