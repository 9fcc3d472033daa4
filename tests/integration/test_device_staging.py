"""The GPU load path's staging, driven on the CPU (docs/loading.md, "CUDA").

A load into a CUDA tensor reads through two pinned host windows (``read.staging``): the same
pieces, window reuse and values as on a device, with plain host windows and synchronous copies
here. ``fill_flat_state`` with a small window on a host tensor takes the staged path a CUDA
engine's partitions take, and must write exactly what the in-place host fill writes, reading
the same bytes; the save side's host copies count what they pinned. What needs a GPU (pinned
memory, CUDA events, real device tensors) is in tests/integration/test_gpu.py (marked ``gpu``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import ucformat
from ucformat.layout.chunking import ChunkPolicy
from ucformat.layout.partition import Fragment
from ucformat.read.partitions import FlatTarget, ReadTally, can_fill_in_place, fill_flat_state
from ucformat.read.staging import DeviceStaging, host_buffer, wants_pinned
from ucformat.sources.live import HostCopies

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def test_pieces_go_through_two_windows() -> None:
    dest = torch.zeros(100, dtype=torch.float32)
    staging = DeviceStaging(dest, "float32", window_bytes=64, pin=False)  # 16 elements each
    assert staging.per_window == 16 and staging.host_bytes == 128
    source = np.arange(100, dtype=np.float32)
    seen: list[int] = []

    def read(out: np.ndarray, at: int, n: int) -> None:
        seen.append(out.ctypes.data)
        out[:] = source[10 + at : 10 + at + n]

    staging.put_range(5, 70, read)
    staging.finish()
    assert staging.pieces == 5 and len(set(seen)) == 2  # 70 elements in 16s, windows reused
    assert torch.equal(dest[5:75], torch.from_numpy(source[10:80]))
    assert not dest[:5].any() and not dest[75:].any()
    with pytest.raises(ValueError, match="exceeds the window"):
        staging.put(0, 17, lambda out: None)


def test_bfloat16_lands_as_its_bits() -> None:
    want = torch.randn(40).to(torch.bfloat16)
    dest = torch.zeros(40, dtype=torch.bfloat16)
    staging = DeviceStaging(dest, "bfloat16", window_bytes=16, pin=False)
    bits = want.view(torch.int16).numpy().view(np.uint16)
    staging.put_range(0, 40, lambda out, at, n: out.__setitem__(slice(None), bits[at : at + n]))
    staging.finish()
    assert torch.equal(dest.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="cannot hold"):
        DeviceStaging(torch.zeros(4, dtype=torch.float64), "float32", pin=False)


def test_host_buffers_are_pinned_only_for_cuda() -> None:
    assert not wants_pinned("cpu") and not wants_pinned(None)
    assert wants_pinned("cuda") == torch.cuda.is_available()
    buffer = host_buffer(10, "bfloat16")
    assert buffer.dtype == np.uint16 and buffer.size == 10


def test_host_copies_count_what_they_pin() -> None:
    copies = HostCopies(always=True, pin=False)
    tensor = torch.arange(6, dtype=torch.float32)
    copy = copies.host(tensor)
    copies.wait()
    assert torch.equal(copy, tensor) and copy.data_ptr() != tensor.data_ptr()
    assert copies.nbytes == 24 and copies.pinned_bytes == 0 and not copy.is_pinned()


def test_a_staged_fill_writes_what_the_in_place_fill_writes(tmp_path: Path) -> None:
    """A rank's flat partition: whole parameters, a parameter cut at the partition's edges,
    and a row-parallel slice of a box-chunked matrix (one fragment per row: a span), filled
    in place on the host and staged through 40-byte windows; equal values and bytes read."""
    from tests.store.direct.test_box_chunks import _write

    policy = ChunkPolicy(chunk_bytes=64, shard_bytes=512, tp_max=2, dp_max=4, box_min_bytes=1)
    _write(tmp_path / "s", policy)
    manifest = ucformat.open(tmp_path / "s").manifest
    rows, cols = manifest.params["emb.weight"].shape
    half = cols // 2
    fragments = [
        Fragment("up.bias", 0, 3, 0, 5),  # a parameter cut at the partition's start
        Fragment("down.weight", 0, 0, 5, 40),
    ]
    at = 45
    fragments += [Fragment("emb.weight", 0, r * cols + half, at + r * (cols - half), cols - half)
                  for r in range(rows)]  # fmt: skip
    numel = at + rows * (cols - half) + 7  # a gap at the end
    target = FlatTarget(0, 0, None, 0, numel)  # type: ignore[arg-type]
    for state, keep in (("fp32", True), ("exp_avg", False)):
        results = []
        for window in (None, 40):
            ckpt = ucformat.open(tmp_path / "s")
            dest = torch.full((numel,), 7.0)
            assert can_fill_in_place(ckpt, target, fragments, state, dest)
            tally = ReadTally()
            before = ckpt.stats.bytes_read
            fill_flat_state(
                ckpt, target, fragments, state, tally, dest, keep_gaps=keep, staging_window=window
            )
            results.append((dest, ckpt.stats.bytes_read - before, tally.bytes_needed))
        (host, host_read, host_needed), (staged, staged_read, staged_needed) = results
        assert torch.equal(host, staged), state
        assert host_needed == staged_needed
        assert staged_read >= host_read  # windows may re-read a chunk cut between two of them
        assert (host[-7:] == 7.0).all() == keep and (host[-7:] == 0).all() != keep
        whole = ucformat.open(tmp_path / "s").read("emb.weight", state).reshape(rows, cols)
        assert torch.equal(
            staged[at : at + rows * (cols - half)].reshape(rows, -1), whole[:, half:]
        )
