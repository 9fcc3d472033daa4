"""``ucformat.verify`` on good stores: no false alarms in any layout, exact counts, and
``--against`` reads each source byte once and finds a changed value."""

from __future__ import annotations

import itertools
import shutil
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucformat
from ucformat.errors import SourceChecksumError
from ucformat.layout.grid import grid_shape
from ucformat.sources.torchfile import TensorRef, open_torch_file

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"
CASES = sorted(p.name for p in DATA.iterdir() if (p / "ckpt").is_dir())
#: (chunk_bytes, shard_bytes, compressor): defaults, odd sizes that cut rows, tiny, one chunk.
LAYOUTS = [(None, None, "none"), (12, 36, "none"), (64, 256, "zstd"), (100, 100, "none")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "-".join(map(str, layout)))
@pytest.mark.parametrize("case", CASES)
def test_verify_accepts_every_fixture_in_every_layout(
    case: str, layout: tuple[int | None, int | None, str], tmp_path: Path
) -> None:
    chunk_bytes, shard_bytes, compressor = layout
    source = DATA / case / "ckpt"
    manifest = ucformat.convert(
        source, tmp_path / "s.ucf", chunk_bytes=chunk_bytes, shard_bytes=shard_bytes,
        compressor=compressor,
    )  # fmt: skip
    report = ucformat.verify(tmp_path / "s.ucf", against=source)
    assert report.ok, [str(p) for p in report.problems]
    refs = [r for e in manifest.params.values() for r in e.states.values()]
    refs += [b.array for b in manifest.buffers.values()]
    assert report.arrays == len(refs)
    assert report.nbytes == report.source_bytes == sum(r.nbytes for r in refs)
    assert report.chunks == sum(prod(grid_shape(r.shape, r.chunk_shape)) for r in refs)
    assert report.summary().startswith(f"ok: {tmp_path / 's.ucf'}: {len(refs)} arrays, ")


def test_against_reads_each_source_byte_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = DATA / "z3-bf16-dsadam-ftb-ws4" / "ckpt"
    ucformat.convert(source, tmp_path / "s.ucf", chunk_bytes=64, shard_bytes=256)
    reads: list[tuple[str, str, int, int]] = []
    original = TensorRef.read_into

    def counting(self: TensorRef, out: np.ndarray, start: int, stop: int) -> None:
        first = (self.offset + start) * self.storage.itemsize
        reads.append((str(self.file.path), self.storage.key, first, out.nbytes))
        original(self, out, start, stop)

    monkeypatch.setattr(TensorRef, "read_into", counting)
    report = ucformat.verify(tmp_path / "s.ucf", against=source)
    assert report.ok
    # FusedAdam keeps 'step' as an int: every byte read from the shards is a compared value
    assert sum(nbytes for *_, nbytes in reads) == report.source_bytes
    spans: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for path, key, first, nbytes in reads:
        spans.setdefault((path, key), []).append((first, first + nbytes))
    for (path, key), ranges in spans.items():
        ranges.sort()
        for (_, stop), (start, _) in itertools.pairwise(ranges):
            assert stop <= start, f"{path} storage {key}: bytes read twice"


def test_against_finds_a_changed_source_value(tmp_path: Path) -> None:
    pristine = DATA / "z2-fp32-dsadam-ftb-ws3" / "ckpt"
    ucformat.convert(pristine, tmp_path / "s.ucf")
    changed = tmp_path / "changed"
    shutil.copytree(pristine, changed)
    shard = changed / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with open_torch_file(shard) as handle:
        fp32: Any = handle.obj["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
        offset, _ = handle.storage_span(fp32.storage.key)
        position = offset + fp32.offset * fp32.storage.itemsize + 5 * 4  # element 5 of rank 1
    data = bytearray(shard.read_bytes())
    data[position] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(SourceChecksumError, match="fails its CRC-32"):  # the zip CRC catches it
        ucformat.verify(tmp_path / "s.ucf", against=changed)
    report = ucformat.verify(tmp_path / "s.ucf", against=changed, check_source=False)
    assert [p.kind for p in report.problems] == ["mismatch"], [str(p) for p in report.problems]
    problem = report.problems[0]
    assert problem.path.startswith("stacks/") and problem.elements is not None
    assert "/fp32)" in problem.message  # the array of the stack that differs
    assert problem.elements[1] - problem.elements[0] == 1
    assert "1 of " in problem.message and "differ from the source" in problem.message
