"""Damaged stores: every flipped byte, deleted object or edited manifest is caught, never loaded.

The store is a committed DeepSpeed fixture (ZeRO-3, bf16, 4 ranks, frozen and tied params,
buffers) converted with 64-byte chunks and 256-byte shards, so arrays have several shards of
several chunks, and small arrays share shards in their stacks (format 3.1). Byte flips run on a
MemoryStore copy (fast); deletions on a local directory.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

import ucformat
from tests.helpers import shard_key
from tests.truth import assert_exact
from ucformat.errors import (
    ChunkMissingError,
    CorruptDataError,
    IncompleteStoreError,
    ManifestError,
)
from ucformat.format.models import ArrayRef, CheckpointManifest
from ucformat.format.spec import buffer_array_path, state_array_path
from ucformat.format.stacks import StoredArray, stored_array
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
    """The store in memory, its manifest and the correct value of every array (by its name,
    ``params/<fqn>/<state>`` or ``buffers/<fqn>``)."""
    store = MemoryStore()
    for file in pristine.rglob("*"):
        if file.is_file():
            key = file.relative_to(pristine).as_posix()
            store._store_dict[key] = default_buffer_prototype().buffer.from_bytes(file.read_bytes())
    ckpt = ucformat.open(store)
    values = {_name(n, s): ckpt.read(n, s) for n, s, _ in _arrays(ckpt.manifest)}
    return store, ckpt.manifest, values


def _name(name: str, state: str) -> str:
    return buffer_array_path(name) if state == "buffer" else state_array_path(name, state)


@dataclass(frozen=True)
class _Object:
    """One shard object of a stack and the logical arrays (name, state, ref) at each index
    of the stack it holds part of."""

    stored: StoredArray
    key: str
    coords: tuple[int, ...]
    members: dict[int, tuple[str, str, ArrayRef]]


def _chunk_objects(manifest: CheckpointManifest) -> list[_Object]:
    """Every shard object of the store (format 3.1: of its stacks)."""
    stacks: dict[str, tuple[StoredArray, dict[int, tuple[str, str, ArrayRef]]]] = {}
    for name, state, ref in _arrays(manifest):
        assert ref.stack is not None
        entry = stacks.setdefault(ref.path, (stored_array(ref), {}))
        entry[1][ref.stack.index] = (name, state, ref)
    objects = []
    for stored, members in stacks.values():
        grid = [-(-d // s) for d, s in zip(stored.shape, stored.shard_shape, strict=True)]
        for coords in np.ndindex(*grid):
            first = coords[0] * stored.shard_shape[0]
            held = range(first, min(first + stored.shard_shape[0], stored.shape[0]))
            objects.append(
                _Object(stored, stored.shard_key(coords), coords, {i: members[i] for i in held})
            )
    return objects


@pytest.fixture(scope="module")
def objects(memory: tuple[MemoryStore, CheckpointManifest, dict[str, Any]]) -> list[_Object]:
    store, manifest, _ = memory
    found = _chunk_objects(manifest)
    assert {o.key for o in found} == {k for k in store._store_dict if "/c." in k}
    assert len(found) > 20 and any(prod(o.stored.shape) > 64 for o in found)
    assert any(len(o.members) > 1 for o in found)  # shards shared by several small arrays
    return found


def _layout(obj: _Object, data: bytes) -> list[tuple[tuple[int, ...], int, int]]:
    """(chunk grid coords in the stack, first byte, stop byte incl. crc) of each inner chunk
    of a shard."""
    ref = obj.stored
    per_shard = [s // c for s, c in zip(ref.shard_shape, ref.chunk_shape, strict=True)]
    count = prod(per_shard)
    index = data[-(16 * count + 4) : -4]
    chunks = []
    for i, local in enumerate(np.ndindex(*per_shard)):
        offset, nbytes = struct.unpack_from("<QQ", index, 16 * i)
        if offset != _EMPTY:
            coords = tuple(s * p + c for s, p, c in zip(obj.coords, per_shard, local, strict=True))
            chunks.append((coords, offset, offset + nbytes))
    return chunks


def _positions(obj: _Object, data: bytes, seed: int) -> dict[int, tuple[int, ...] | None]:
    """Byte positions worth flipping -> the chunk that holds them (None: the shard index).

    Every chunk's first data byte and each of its 4 crc32c bytes, every index entry's first
    offset and length byte, the 4 index crc bytes, and random bytes anywhere.
    """
    chunks = _layout(obj, data)
    positions: dict[int, tuple[int, ...] | None] = {}
    for coords, start, stop in chunks:
        for position in (start, *range(stop - 4, stop)):
            positions[position] = coords
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


def _holder(obj: _Object, coords: tuple[int, ...] | None) -> tuple[str, str, ArrayRef]:
    """The logical array a flip at chunk ``coords`` damages (the index: the shard's first)."""
    return obj.members[coords[0]] if coords is not None else next(iter(obj.members.values()))


def _flip(store: MemoryStore, key: str, position: int) -> Any:
    original = store._store_dict[key]
    data = bytearray(original.to_bytes())
    data[position] ^= 0x5A
    store._store_dict[key] = default_buffer_prototype().buffer.from_bytes(bytes(data))
    return original


def test_every_chunk_object_flip_is_refused_on_load_and_named(memory: Any, objects: Any) -> None:
    """A flipped byte fails the logical array whose chunk holds it (a flipped index: every
    array of the shard), naming it and the chunk; the other arrays of a shared shard still
    read exactly."""
    store, _, values = memory
    flips = 0
    for number, obj in enumerate(objects):
        data = store._store_dict[obj.key].to_bytes()
        for position, coords in _positions(obj, data, seed=number).items():
            name, state, ref = _holder(obj, coords)
            original = _flip(store, obj.key, position)
            try:
                ckpt = ucformat.open(store)
                with pytest.raises(CorruptDataError) as caught:
                    ckpt.read(name, state)
                if coords is not None:  # a chunk's damage is its array's alone
                    for other, other_state, _ in obj.members.values():
                        if (other, other_state) != (name, state):
                            got = ckpt.read(other, other_state)
                            assert_exact(got, values[_name(other, other_state)], "neighbour")
            finally:
                store._store_dict[obj.key] = original
            message = str(caught.value)
            label = f"{_name(name, state)} ({ref.path}[{coords[0] if coords else ref.stack.index}])"
            assert message.startswith(f"{label}: chunk ("), message
            if coords is not None:  # a flip inside a chunk names exactly that chunk
                start, stop = chunk_flat_range(obj.stored.shape, obj.stored.chunk_shape, coords)
                where = "(" + ", ".join(map(str, coords)) + ")"
                assert f"chunk {where} (elements [{start}, {stop}))" in message
            assert "\n" not in message
            flips += 1
    assert flips > 500


def test_every_byte_of_one_shard_is_covered(memory: Any, objects: Any) -> None:
    store, manifest, _ = memory
    ref = manifest.params["emb.weight"].states["fp32"]
    key = shard_key(ref, (1, 0))
    obj = next(o for o in objects if o.key == key)
    data = store._store_dict[key].to_bytes()
    assert len(_layout(obj, data)) == 2  # ZeRO-3 x4: shards of one rank's 4 rows
    label = re.escape(f"params/emb.weight/fp32 ({ref.path}[{ref.stack.index}])")
    for position in range(len(data)):
        original = _flip(store, key, position)
        try:
            with pytest.raises(CorruptDataError, match=f"^{label}: chunk "):
                ucformat.open(store).read("emb.weight", "fp32")
        finally:
            store._store_dict[key] = original


def test_verify_names_the_array_and_chunk_of_each_flip(memory: Any, objects: Any) -> None:
    store, manifest, _ = memory
    assert ucformat.verify(store).ok
    rng = random.Random(7)
    for obj in objects:
        data = store._store_dict[obj.key].to_bytes()
        positions = _positions(obj, data, seed=0)
        by_kind = {
            "chunk data": [p for p, c in positions.items() if c is not None and p < len(data) - 4],
            "index": [p for p, c in positions.items() if c is None],
        }
        for kind, candidates in by_kind.items():
            if not candidates:
                continue
            position = rng.choice(candidates)
            original = _flip(store, obj.key, position)
            try:
                report = ucformat.verify(store)
            finally:
                store._store_dict[obj.key] = original
            assert not report.ok, (obj.key, position)
            assert {p.path for p in report.problems} == {obj.stored.path}, report.problems
            assert all(p.kind == "checksum" for p in report.problems)
            coords = positions[position]
            if coords is not None:
                name, state, _ = _holder(obj, coords)
                assert [p.chunk for p in report.problems] == [coords], (name, state, kind)
                problem = report.problems[0]
                stored = obj.stored
                assert problem.elements == chunk_flat_range(
                    stored.shape, stored.chunk_shape, coords
                )
                assert "fails its crc32c checksum" in problem.message
                assert f" of {_name(name, state)} " in problem.message  # the array it holds
            assert report.arrays == len(list(_arrays(manifest)))


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
            assert_exact(loaded, values[_name(name, state)], f"{key} flipped at {position}")


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
    ref = ucformat.open(on_disk).manifest.params["emb.weight"].states["exp_avg"]
    assert ref.stack is not None
    key = shard_key(ref, (1, 0))
    (on_disk / key).unlink()
    with pytest.raises(ChunkMissingError, match=re.escape(f"{key}: this chunk")):
        ucformat.open(on_disk).read("emb.weight", "exp_avg")
    assert ucformat.open(on_disk).read_range("emb.weight", "exp_avg", 0, 32).shape == (32,)
    report = ucformat.verify(on_disk)
    offset = ref.stack.index * 128  # emb.weight is (16, 8)
    assert [(p.kind, p.path, p.chunk, p.elements) for p in report.problems] == [
        ("missing", ref.path, (ref.stack.index, 1, 0), (offset + 32, offset + 64))
    ]
    assert f"'{key}' is missing" in report.problems[0].message
    assert "(params/emb.weight/exp_avg) are lost" in report.problems[0].message


def test_deleted_scalar_chunk_is_missing(on_disk: Path) -> None:
    """A 0-d buffer lies in a stack of 0-d arrays (one chunk each): its shard is missing."""
    ref = ucformat.open(on_disk).manifest.buffers["bn.num_batches_tracked"].array
    assert ref.shape == [] and ref.stack is not None
    (on_disk / shard_key(ref, ())).unlink()
    with pytest.raises(ChunkMissingError):
        ucformat.open(on_disk).read("bn.num_batches_tracked", "buffer")
    report = ucformat.verify(on_disk)
    assert [(p.kind, p.path) for p in report.problems] == [("missing", ref.path)]
    assert "buffers/bn.num_batches_tracked" in report.problems[0].message


def test_deleted_array_metadata(on_disk: Path) -> None:
    manifest = ucformat.open(on_disk).manifest
    expected = ucformat.open(on_disk).read("up.bias", "fp32")
    ref = manifest.params["up.bias"].states["fp32"]
    (on_disk / ref.path / "zarr.json").unlink()
    # readers take array metadata from the digest-checked manifest: still the exact values
    assert_exact(ucformat.open(on_disk).read("up.bias", "fp32"), expected, "up.bias")
    report = ucformat.verify(on_disk)
    assert [(p.kind, p.path, p.message) for p in report.problems] == [
        ("missing", ref.path, "zarr.json is missing")
    ]
    shards = len(_chunk_objects(manifest))
    assert report.arrays == 20 and report.shards == shards


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
    """An array edited apart from its stack is refused with the manifest; the whole stack
    edited alike is reported array by array, and its data not checked."""
    stack = ucformat.open(on_disk).manifest.params["emb.weight"].states["fp32"].path

    def edit_one(data: dict[str, Any]) -> None:
        data["params"]["emb.weight"]["states"]["fp32"]["chunk_shape"] = [3, 8]

    _edit_manifest(on_disk, edit_one)
    with pytest.raises(ManifestError, match=f"in stack '{stack}' has layout"):
        ucformat.open(on_disk)
    report = ucformat.verify(on_disk, keep_going=True)
    assert [p.kind for p in report.problems] == ["manifest"]
    assert f"in stack '{stack}' has layout" in report.problems[0].message

    def edit_stack(data: dict[str, Any]) -> None:
        for entry in data["params"].values():
            for ref in entry["states"].values():
                if ref["path"] == stack:
                    ref["chunk_shape"] = [3, 8]

    _edit_manifest(on_disk, edit_stack)
    report = ucformat.verify(on_disk, keep_going=True)
    messages = [str(p) for p in report.problems]
    assert messages[0] == "ucformat.json: digest mismatch: edited after it was written"
    states = ("fp32", "exp_avg", "exp_avg_sq")
    assert messages[1:] == [
        line
        for state in states
        for line in (
            f"ucformat.json: param 'emb.weight' state '{state}': shard shape [4, 8] is not a "
            "flat-contiguous block of whole chunks [3, 8]",
            f"{stack}: its chunks were not checked",
        )
    ]


def test_unparsable_manifest_is_one_problem(on_disk: Path) -> None:
    (on_disk / "ucformat.json").write_text("{oops")
    report = ucformat.verify(on_disk)
    assert [(p.kind, p.path) for p in report.problems] == [("manifest", "ucformat.json")]
    assert "not valid JSON" in report.problems[0].message
    with pytest.raises(ManifestError, match="not valid JSON"):
        ucformat.open(on_disk)
