"""The direct read path tells "not applicable" from "corrupt", and never returns corrupt data.

A shard index can pass its own crc32c and still be wrong for a ucformat array: a chunk marked
absent (zarr then returns the fill value, zeros, as the chunk's values) or of the wrong size.
The direct path finds these; the readers, the loader's in-place check and ``verify`` refuse them.
Run on a real converted DeepSpeed fixture, on a local directory (``preadv``) and in memory (range
requests through the store).
"""

from __future__ import annotations

import re
import shutil
import struct
from math import prod
from pathlib import Path

import crc32c
import numpy as np
import pytest
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import MemoryStore

import ucformat
from ucformat.errors import CorruptDataError
from ucformat.format.dtypes import numpy_storage_dtype
from ucformat.format.models import ArrayRef
from ucformat.format.stacks import StoredArray, placement
from ucformat.layout.grid import chunk_flat_range
from ucformat.store.arrays import read_box
from ucformat.store.direct.shard_read import DirectRead, Outcome, read_flat_range

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "data" / "z3-bf16-dsadam-ftb-ws4"
ABSENT = 2**64 - 1


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("direct") / "store.ucf"
    ucformat.convert(FIXTURE / "ckpt", path, chunk_bytes=64, shard_bytes=256)
    return path


@pytest.fixture
def store(pristine: Path, tmp_path: Path) -> Path:
    path = tmp_path / "store.ucf"
    shutil.copytree(pristine, path)
    return path


def _biggest(path: Path) -> tuple[str, ArrayRef]:
    manifest = ucformat.open(path).manifest
    name = max(manifest.params, key=lambda n: manifest.params[n].numel)
    return name, manifest.params[name].states["exp_avg"]


def _chunk(ref: ArrayRef, coords: tuple[int, ...]) -> tuple[tuple[int, ...], int, int]:
    """Chunk ``coords`` of the logical array ``ref`` as its stack names it: coordinates in the
    stack, and its flat element range there."""
    offset = placement(ref)[1]
    start, stop = chunk_flat_range(ref.shape, ref.chunk_shape, coords)
    where = coords if ref.stack is None else (ref.stack.index, *coords)
    return where, offset + start, offset + stop


def _shard(store: Path, ref: ArrayRef, coords: tuple[int, ...]) -> Path:
    """The file of shard ``coords`` (in the logical array's grid) of ``ref``."""
    from tests.helpers import shard_key

    return store / shard_key(ref, coords)


def _rewrite_index(shard: Path, ref: ArrayRef, entry: int, value: tuple[int, int]) -> None:
    """Set index entry ``entry`` of ``shard`` to ``value`` and give the index a valid crc32c."""
    data = bytearray(shard.read_bytes())
    count = prod(s // c for s, c in zip(ref.shard_shape, ref.chunk_shape, strict=True))
    begin = len(data) - (16 * count + 4)
    struct.pack_into("<QQ", data, begin + 16 * entry, *value)
    struct.pack_into("<I", data, len(data) - 4, crc32c.crc32c(bytes(data[begin:-4])))
    shard.write_bytes(bytes(data))


def _in_memory(path: Path) -> MemoryStore:
    memory = MemoryStore()
    for file in path.rglob("*"):
        if file.is_file():
            key = file.relative_to(path).as_posix()
            memory._store_dict[key] = default_buffer_prototype().buffer.from_bytes(
                file.read_bytes()
            )
    return memory


def _direct(ckpt: ucformat.UniversalCheckpoint, ref: ArrayRef, start: int, stop: int) -> DirectRead:
    out = np.empty(stop - start, dtype=numpy_storage_dtype(ref.dtype))
    stored, offset = placement(ref)
    return read_flat_range(ckpt.store, stored, stored.shard_key, offset + start, offset + stop, out)


def test_ok_not_applicable_and_corrupt_are_three_outcomes(store: Path, tmp_path: Path) -> None:
    _, ref = _biggest(store)
    numel = prod(ref.shape)
    assert _direct(ucformat.open(store), ref, 0, numel).outcome is Outcome.OK
    zstd = tmp_path / "zstd.ucf"
    ucformat.convert(FIXTURE / "ckpt", zstd, chunk_bytes=64, shard_bytes=256, compressor="zstd")
    _, compressed = _biggest(zstd)
    assert compressed.compressor == "zstd"
    assert _direct(ucformat.open(zstd), compressed, 0, numel).outcome is Outcome.NOT_APPLICABLE
    shard = _shard(store, ref, (0, 0))
    data = bytearray(shard.read_bytes())
    data[0] ^= 0x01  # the first data byte of the shard's first chunk, chunk (0, 0)
    shard.write_bytes(bytes(data))
    where, start, stop = _chunk(ref, (0, 0))
    for ckpt in (ucformat.open(store), ucformat.open(_in_memory(store))):
        result = _direct(ckpt, ref, 0, numel)
        assert result.outcome is Outcome.CORRUPT
        expected = f"chunk {where} (elements [{start}, {stop})) fails its crc32c checksum"
        assert result.problem == expected


@pytest.mark.parametrize("in_memory", [False, True])
def test_a_chunk_marked_absent_in_a_valid_index_is_refused(store: Path, in_memory: bool) -> None:
    name, ref = _biggest(store)
    shard = _shard(store, ref, (1, 0))
    _rewrite_index(shard, ref, 0, (ABSENT, ABSENT))  # local chunk (0, 0) of shard (1, 0)
    coords = (ref.shard_shape[0] // ref.chunk_shape[0], 0)
    chunk, start, stop = _chunk(ref, coords)
    target = _in_memory(store) if in_memory else store
    ckpt = ucformat.open(target)
    stored: StoredArray = placement(ref)[0]
    # zarr alone reads the chunk as its fill value: the damage is invisible to its decoder
    everything = (slice(None),) * len(stored.shape)
    zeros = read_box(ckpt._array(stored), everything).reshape(-1)[start:stop]
    assert not zeros.any()
    where = f"chunk {chunk} (elements [{start}, {stop})) is absent from the index of "
    key = shard.relative_to(store).as_posix()
    message = "^" + re.escape(f"{ckpt.describe(ref)}: {where}'{key}'; the store is corrupt")
    with pytest.raises(CorruptDataError, match=message):
        ckpt.read(name, "exp_avg")
    begin = start - placement(ref)[1]
    with pytest.raises(CorruptDataError, match=message):
        ckpt.read_range(name, "exp_avg", begin + 1, begin + 2)
    if not in_memory:  # the loader's in-place check (local stores only)
        with pytest.raises(CorruptDataError, match=message):
            ckpt.check_range(ref, begin, begin + stop - start)
    report = ucformat.verify(target)
    assert [(p.kind, p.path) for p in report.problems] == [("checksum", ref.path)]
    assert "is absent from the index" in report.problems[0].message
    assert f"params/{name}/exp_avg" in report.problems[0].message  # the array it holds
    ucformat.open(target).read_range(name, "exp_avg", 0, begin)  # the rest reads fine


def test_a_chunk_of_the_wrong_size_in_a_valid_index_is_refused(store: Path) -> None:
    name, ref = _biggest(store)
    shard = _shard(store, ref, (1, 0))
    data = shard.read_bytes()
    count = prod(s // c for s, c in zip(ref.shard_shape, ref.chunk_shape, strict=True))
    offset, nbytes = struct.unpack_from("<QQ", data, len(data) - (16 * count + 4))
    _rewrite_index(shard, ref, 0, (offset, nbytes - 4))
    ckpt = ucformat.open(store)
    with pytest.raises(CorruptDataError, match=f"^{re.escape(ckpt.describe(ref))}: chunk "):
        ckpt.read(name, "exp_avg")
    with pytest.raises(CorruptDataError, match=f" is {nbytes - 4} bytes in the index of "):
        ckpt.check_range(ref, 0, prod(ref.shape))
    assert not ucformat.verify(store).ok
