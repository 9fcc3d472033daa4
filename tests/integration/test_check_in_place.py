"""The in-place check the DeepSpeed loader runs before it writes into an engine.

``UniversalCheckpoint.check_range`` must say yes exactly when every chunk holding a range is
present and passes its checksum, on a real converted DeepSpeed fixture (64-byte chunks in
256-byte shards, so ranges cross chunks and shards), raise for damage, naming the chunk, and say
no (read through a staging buffer) for layouts it does not handle.
"""

from __future__ import annotations

import re
from math import prod
from pathlib import Path

import pytest

import ucformat
from tests.helpers import shard_key
from ucformat.errors import ChunkMissingError, CorruptDataError
from ucformat.format.models import ArrayRef
from ucformat.layout.grid import chunk_flat_range

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "data" / "z3-bf16-dsadam-ftb-ws4"
CHUNK_BYTES, SHARD_BYTES = 64, 256


def _convert(tmp_path: Path, **options: object) -> Path:
    store = tmp_path / "ckpt.ucf"
    ucformat.convert(FIXTURE / "ckpt", store, chunk_bytes=CHUNK_BYTES, shard_bytes=SHARD_BYTES,
                     **options)  # type: ignore[arg-type]  # fmt: skip
    return store


def _biggest(store: Path) -> tuple[str, ArrayRef]:
    manifest = ucformat.open(store).manifest
    name = max(manifest.params, key=lambda n: manifest.params[n].numel)
    return name, manifest.params[name].states["exp_avg"]


def test_a_good_store_checks_out_for_any_range(tmp_path: Path) -> None:
    store = _convert(tmp_path)
    ckpt = ucformat.open(store)
    for entry in ckpt.manifest.params.values():
        for ref in entry.states.values():
            numel = entry.numel
            for start, stop in [(0, numel), (1, max(1, numel - 1)), (numel // 3, numel // 2)]:
                assert ckpt.check_range(ref, start, stop), (ref.path, start, stop)
    assert ckpt.stats.bytes_read <= 16 * 1024  # shard indexes only: the check copies no data


def test_a_flipped_byte_fails_exactly_the_ranges_that_hold_it(tmp_path: Path) -> None:
    store = _convert(tmp_path)
    _, ref = _biggest(store)
    shard = store / shard_key(ref, (1, 0))  # the second shard of a 2-d array
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x01  # inside the shard's first chunk
    shard.write_bytes(bytes(data))
    ckpt = ucformat.open(store)
    first_chunk = chunk_flat_range(ref.shape, ref.shard_shape, (1, 0))[0]
    chunk_elements = CHUNK_BYTES // 4
    coords = (ref.shard_shape[0] // ref.chunk_shape[0], 0)  # the shard's first chunk
    start, stop = chunk_flat_range(ref.shape, ref.chunk_shape, coords)
    assert (start, stop) == (first_chunk, first_chunk + chunk_elements)
    assert ref.stack is not None  # named in its stack: (index, *coords), flat from its offset
    offset = ref.stack.index * prod(ref.shape)
    where = f"chunk {(ref.stack.index, *coords)} (elements [{offset + start}, {offset + stop}))"
    for low, high in [(first_chunk, first_chunk + 1), (0, first_chunk + chunk_elements)]:
        with pytest.raises(CorruptDataError) as caught:
            ckpt.check_range(ref, low, high)
        assert str(caught.value).startswith(
            f"{ckpt.describe(ref)}: {where} fails its crc32c checksum"
        )
    assert ckpt.check_range(ref, 0, first_chunk)  # the first shard is intact
    assert ckpt.check_range(ref, first_chunk + chunk_elements, first_chunk + 2 * chunk_elements)


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    store = _convert(tmp_path)
    _, ref = _biggest(store)
    key = shard_key(ref, (0, 0))
    (store / key).unlink()
    with pytest.raises(ChunkMissingError, match=f"{key}: this chunk object is missing"):
        ucformat.open(store).check_range(ref, 0, 1)


@pytest.mark.parametrize("keep", [0, 100])
def test_a_short_shard_fails(tmp_path: Path, keep: int) -> None:
    store = _convert(tmp_path)
    _, ref = _biggest(store)
    key = shard_key(ref, (0, 0))
    shard = store / key
    shard.write_bytes(shard.read_bytes()[:keep])
    ckpt = ucformat.open(store)
    label = re.escape(ckpt.describe(ref))
    with pytest.raises(CorruptDataError, match=f"^{label}: .*shard object '{key}'"):
        ckpt.check_range(ref, 0, 1)


def test_compressed_stores_are_never_read_in_place(tmp_path: Path) -> None:
    store = _convert(tmp_path, compressor="zstd")
    _, ref = _biggest(store)
    assert not ucformat.open(store).check_range(ref, 0, 1)
