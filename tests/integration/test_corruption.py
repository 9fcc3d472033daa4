"""Damaged stores: every flipped byte, deleted object or edited manifest is caught, never loaded.

The store is a committed DeepSpeed fixture (ZeRO-3, bf16, 4 ranks, frozen and tied params,
buffers) converted with 64-byte chunks and 256-byte shards, so arrays have several shards of
several chunks. Byte flips run on a MemoryStore copy (fast); deletions on a local directory.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from collections.abc import Iterator
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

import ucformat
from tests.truth import assert_exact
from ucformat.errors import (
    ChunkMissingError,
    CorruptDataError,
    IncompleteStoreError,
    ManifestError,
)
from ucformat.format.models import ArrayRef, CheckpointManifest
from ucformat.layout.grid import chunk_flat_range

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "data" / "z3-bf16-dsadam-ftb-ws4"
CHUNK_BYTES, SHARD_BYTES = 64, 256
_EMPTY = 2**64 - 1


def _arrays(manifest: CheckpointManifest) -> Iterator[tuple[str, str, ArrayRef]]:
    """(name, state, ref) of every array; buffers have state 'buffer'."""
    for name, entry in manifest.params.items():
        for state, ref in entry.states.items():
            yield name, state, ref
    for name, buffer in manifest.buffers.items():
        yield name, "buffer", buffer.array


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corruption") / "store.ucf"
    ucformat.convert(FIXTURE / "ckpt", path, chunk_bytes=CHUNK_BYTES, shard_bytes=SHARD_BYTES)
    return path


@pytest.fixture(scope="module")
def memory(pristine: Path) -> tuple[MemoryStore, CheckpointManifest, dict[str, Any]]:
    """The store in memory, its manifest and the correct value of every array."""
    store = MemoryStore()
    for file in pristine.rglob("*"):
        if file.is_file():
            key = file.relative_to(pristine).as_posix()
            store._store_dict[key] = default_buffer_prototype().buffer.from_bytes(file.read_bytes())
    ckpt = ucformat.open(store)
    values = {ref.path: ckpt.read(name, state) for name, state, ref in _arrays(ckpt.manifest)}
    return store, ckpt.manifest, values


def _chunk_objects(manifest: CheckpointManifest) -> list[tuple[str, str, ArrayRef, str]]:
    """(name, state, ref, key) for every stored chunk/shard object."""
    objects = []
    for name, state, ref in _arrays(manifest):
        if not ref.shape:
            objects.append((name, state, ref, f"{ref.path}/c"))
            continue
        grid = [-(-d // s) for d, s in zip(ref.shape, ref.shard_shape, strict=True)]
        for coords in np.ndindex(*grid):
            objects.append((name, state, ref, f"{ref.path}/c/" + "/".join(map(str, coords))))
    return objects


@pytest.fixture(scope="module")
def objects(memory: tuple[MemoryStore, CheckpointManifest, dict[str, Any]]) -> list[Any]:
    store, manifest, _ = memory
    found = _chunk_objects(manifest)
    assert {key for *_, key in found} == {k for k in store._store_dict if "/c" in k}
    assert len(found) > 20 and any(prod(ref.shape) > 64 for _, _, ref, _ in found)
    return found


def _layout(ref: ArrayRef, key: str, data: bytes) -> list[tuple[tuple[int, ...], int, int]]:
    """(chunk grid coords, first byte, stop byte incl. crc) of each inner chunk of a shard."""
    if not ref.shape:
        return [((), 0, len(data))]
    per_shard = [s // c for s, c in zip(ref.shard_shape, ref.chunk_shape, strict=True)]
    shard = [int(part) for part in key.rsplit("/c/", 1)[1].split("/")]
    count = prod(per_shard)
    index = data[-(16 * count + 4) : -4]
    chunks = []
    for i, local in enumerate(np.ndindex(*per_shard)):
        offset, nbytes = struct.unpack_from("<QQ", index, 16 * i)
        if offset != _EMPTY:
            coords = tuple(s * p + c for s, p, c in zip(shard, per_shard, local, strict=True))
            chunks.append((coords, offset, offset + nbytes))
    return chunks


def _positions(
    ref: ArrayRef, key: str, data: bytes, seed: int
) -> dict[int, tuple[int, ...] | None]:
    """Byte positions worth flipping -> the chunk that holds them (None: the shard index).

    Every chunk's first data byte and each of its 4 crc32c bytes, every index entry's first
    offset and length byte, the 4 index crc bytes, and random bytes anywhere.
    """
    chunks = _layout(ref, key, data)
    positions: dict[int, tuple[int, ...] | None] = {}
    for coords, start, stop in chunks:
        for position in (start, *range(stop - 4, stop)):
            positions[position] = coords
    if ref.shape:
        index_start = len(data) - (16 * len(chunks) + 4)
        for i in range(len(chunks)):
            positions[index_start + 16 * i] = None
            positions[index_start + 16 * i + 8] = None
        positions.update(dict.fromkeys(range(len(data) - 4, len(data))))
    rng = random.Random(seed)
    for position in rng.sample(range(len(data)), min(8, len(data))):
        owner = [c for c, start, stop in chunks if start <= position < stop]
        positions.setdefault(position, owner[0] if owner else None)
    return positions


def _flip(store: MemoryStore, key: str, position: int) -> Any:
    original = store._store_dict[key]
    data = bytearray(original.to_bytes())
    data[position] ^= 0x5A
    store._store_dict[key] = default_buffer_prototype().buffer.from_bytes(bytes(data))
    return original


def test_every_chunk_object_flip_is_refused_on_load_and_named(memory: Any, objects: Any) -> None:
    store, _, _ = memory
    flips = 0
    for number, (name, state, ref, key) in enumerate(objects):
        data = store._store_dict[key].to_bytes()
        for position, coords in _positions(ref, key, data, seed=number).items():
            original = _flip(store, key, position)
            try:
                with pytest.raises(CorruptDataError) as caught:
                    ucformat.open(store).read(name, state)
            finally:
                store._store_dict[key] = original
            message = str(caught.value)
            assert message.startswith(f"{ref.path}: chunk ("), message
            if coords is not None:  # a flip inside a chunk names exactly that chunk
                start, stop = chunk_flat_range(ref.shape, ref.chunk_shape, coords)
                where = "(" + ", ".join(map(str, coords)) + ")"
                assert f"chunk {where} (elements [{start}, {stop}))" in message
            assert "\n" not in message
            flips += 1
    assert flips > 500


def test_every_byte_of_one_shard_is_covered(memory: Any, objects: Any) -> None:
    store, _, _ = memory
    name, state, ref, key = next(o for o in objects if o[3].endswith("emb.weight/fp32/c/1/0"))
    data = store._store_dict[key].to_bytes()
    assert len(_layout(ref, key, data)) == 2  # ZeRO-3 x4: shards of one rank's 4 rows
    for position in range(len(data)):
        original = _flip(store, key, position)
        try:
            with pytest.raises(CorruptDataError, match=f"^{ref.path}: chunk "):
                ucformat.open(store).read(name, state)
        finally:
            store._store_dict[key] = original


def test_verify_names_the_array_and_chunk_of_each_flip(memory: Any, objects: Any) -> None:
    store, _, _ = memory
    assert ucformat.verify(store).ok
    rng = random.Random(7)
    for name, state, ref, key in objects:
        data = store._store_dict[key].to_bytes()
        positions = _positions(ref, key, data, seed=0)
        by_kind = {
            "chunk data": [p for p, c in positions.items() if c is not None and p < len(data) - 4],
            "index": [p for p, c in positions.items() if c is None],
        }
        for kind, candidates in by_kind.items():
            if not candidates:
                continue
            position = rng.choice(candidates)
            original = _flip(store, key, position)
            try:
                report = ucformat.verify(store)
            finally:
                store._store_dict[key] = original
            assert not report.ok, (key, position)
            assert {p.path for p in report.problems} == {ref.path}, report.problems
            assert all(p.kind == "checksum" for p in report.problems)
            coords = positions[position]
            if coords is not None:
                assert [p.chunk for p in report.problems] == [coords], (name, state, kind)
                problem = report.problems[0]
                assert problem.elements == chunk_flat_range(ref.shape, ref.chunk_shape, coords)
                assert "fails its crc32c checksum" in problem.message
            assert report.arrays == len(list(_arrays(ucformat.open(store).manifest)))


def test_flipped_array_metadata_is_reported_and_never_loads_wrong_numbers(memory: Any) -> None:
    store, manifest, values = memory
    rng = random.Random(3)
    for name, state, ref in rng.sample(list(_arrays(manifest)), 4):
        key = f"{ref.path}/zarr.json"
        data = store._store_dict[key].to_bytes()
        text = data.decode()
        # the shape, the dtype, the codec chain, the fill value, and random bytes
        anchors = ('"shape": [', '"data_type": "', '"crc32c', '"fill_value": ', '"little')
        chosen = {text.index(a) + len(a) - 1 for a in anchors if a in text}
        chosen |= set(rng.sample(range(len(data)), 6))
        for position in sorted(chosen):
            original = _flip(store, key, position)
            try:
                report = ucformat.verify(store)
                loaded = ucformat.open(store).read(name, state)
            finally:
                store._store_dict[key] = original
            assert report.problems, (key, position)
            assert {(p.kind, p.path) for p in report.problems} == {("metadata", ref.path)}
            assert report.problems[0].message.startswith(("zarr.json is not valid JSON", "'"))
            assert report.arrays == len(list(_arrays(manifest)))  # the data is still checked
            # readers take array metadata from the digest-checked manifest: the exact values
            assert_exact(loaded, values[ref.path], f"{key} flipped at {position}")


def test_flipped_root_metadata_is_reported(memory: Any) -> None:
    store, _, _ = memory
    original = _flip(store, "zarr.json", 10)
    try:
        report = ucformat.verify(store)
    finally:
        store._store_dict["zarr.json"] = original
    assert [p.path for p in report.problems] == ["zarr.json"]


@pytest.fixture
def on_disk(pristine: Path, tmp_path: Path) -> Path:
    path = tmp_path / "store.ucf"
    shutil.copytree(pristine, path)
    return path


def test_deleted_shard_is_missing_on_load_and_in_verify(on_disk: Path) -> None:
    (on_disk / "params/emb.weight/exp_avg/c/1/0").unlink()
    with pytest.raises(ChunkMissingError, match=r"params/emb\.weight/exp_avg/c/1/0: this chunk"):
        ucformat.open(on_disk).read("emb.weight", "exp_avg")
    assert ucformat.open(on_disk).read_range("emb.weight", "exp_avg", 0, 32).shape == (32,)
    report = ucformat.verify(on_disk)
    assert [(p.kind, p.path, p.chunk, p.elements) for p in report.problems] == [
        ("missing", "params/emb.weight/exp_avg", (1, 0), (32, 64))
    ]
    assert "c/1/0' is missing" in report.problems[0].message


def test_deleted_scalar_chunk_is_missing(on_disk: Path) -> None:
    (on_disk / "buffers/bn.num_batches_tracked/c").unlink()
    with pytest.raises(ChunkMissingError):
        ucformat.open(on_disk).read("bn.num_batches_tracked", "buffer")
    report = ucformat.verify(on_disk)
    assert [(p.kind, p.path) for p in report.problems] == [
        ("missing", "buffers/bn.num_batches_tracked")
    ]


def test_deleted_array_metadata(on_disk: Path) -> None:
    expected = ucformat.open(on_disk).read("up.bias", "fp32")
    (on_disk / "params/up.bias/fp32/zarr.json").unlink()
    # readers take array metadata from the digest-checked manifest: still the exact values
    assert_exact(ucformat.open(on_disk).read("up.bias", "fp32"), expected, "up.bias")
    report = ucformat.verify(on_disk)
    assert [(p.kind, p.path, p.message) for p in report.problems] == [
        ("missing", "params/up.bias/fp32", "zarr.json is missing")
    ]
    assert report.arrays == 20 and report.shards == 29


def test_deleted_manifest_is_an_incomplete_store(on_disk: Path) -> None:
    (on_disk / "ucformat.json").unlink()
    for call in (ucformat.open, ucformat.verify):
        with pytest.raises(IncompleteStoreError, match="incomplete ucformat store"):
            call(on_disk)


def _edit_manifest(path: Path, edit: Any) -> None:
    data = json.loads((path / "ucformat.json").read_text())
    edit(data)
    (path / "ucformat.json").write_text(json.dumps(data))


def test_edited_manifest_value_fails_its_digest(on_disk: Path) -> None:
    _edit_manifest(on_disk, lambda d: d["progress"].update(global_steps=5))
    with pytest.raises(ManifestError, match="digest mismatch; the manifest was edited"):
        ucformat.open(on_disk)
    report = ucformat.verify(on_disk)  # stops there: an edited manifest is not to be trusted
    assert [str(p) for p in report.problems] == [
        "ucformat.json: digest mismatch: edited after it was written",
        "ucformat.json: arrays not checked: the manifest cannot be trusted (pass "
        "keep_going=True, or --keep-going, to check them anyway)",
    ]
    assert report.arrays == 0
    report = ucformat.verify(on_disk, keep_going=True)
    assert [(p.kind, p.path) for p in report.problems] == [("manifest", "ucformat.json")]
    assert "digest mismatch" in report.problems[0].message
    assert report.arrays == 20  # the arrays are still checked


def test_removed_digest_is_refused(on_disk: Path) -> None:
    _edit_manifest(on_disk, lambda d: d.update(digest=None))
    with pytest.raises(ManifestError, match="carries no digest"):
        ucformat.open(on_disk)
    assert not ucformat.verify(on_disk).ok


def test_edited_array_reference_is_caught(on_disk: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["params"]["emb.weight"]["states"]["fp32"]["chunk_shape"] = [3, 8]

    _edit_manifest(on_disk, edit)
    report = ucformat.verify(on_disk, keep_going=True)
    messages = [str(p) for p in report.problems]
    assert messages == [
        "ucformat.json: digest mismatch: edited after it was written",
        "ucformat.json: param 'emb.weight' state 'fp32': shard shape [4, 8] is not a "
        "flat-contiguous block of whole chunks [3, 8]",
        "params/emb.weight/fp32: its chunks were not checked",
    ]


def test_unparsable_manifest_is_one_problem(on_disk: Path) -> None:
    (on_disk / "ucformat.json").write_text("{oops")
    report = ucformat.verify(on_disk)
    assert [(p.kind, p.path) for p in report.problems] == [("manifest", "ucformat.json")]
    assert "not valid JSON" in report.problems[0].message
    with pytest.raises(ManifestError, match="not valid JSON"):
        ucformat.open(on_disk)
