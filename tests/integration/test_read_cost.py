"""The read-cost model (ucformat.layout.reads) predicts exactly the bytes and requests a reader
makes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import ucformat
from tests.helpers import read_cost

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "data" / "z2-fp32-dsadam-ftb-ws3"


@pytest.mark.parametrize(("chunk_bytes", "shard_bytes"), [(64, 256), (40, 40), (1024, 4096)])
def test_predicted_bytes_equal_fetched_bytes(
    tmp_path: Path, chunk_bytes: int, shard_bytes: int
) -> None:
    ucformat.convert(
        FIXTURE / "ckpt", tmp_path / "s", chunk_bytes=chunk_bytes, shard_bytes=shard_bytes
    )
    rng = random.Random(0)
    for trial in range(40):
        ckpt = ucformat.open(tmp_path / "s")  # fresh index cache per trial
        name = rng.choice(sorted(ckpt.manifest.params))
        ref = ckpt.array_ref(name, "fp32")
        numel = ckpt.manifest.params[name].numel
        ranges = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(numel)
            ranges.append((start, rng.randint(start + 1, numel)))
        before, requests_before = ckpt.stats.bytes_read, ckpt.stats.requests
        for start, stop in ranges:
            ckpt.read_range(name, "fp32", start, stop)
        fetched = ckpt.stats.bytes_read - before
        requests = ckpt.stats.requests - requests_before
        cost = read_cost(ref, ranges)  # in the geometry of its stack (format 3.1)
        assert requests == cost.requests, (trial, name, ranges)  # indexes cached, one run each
        if len(ranges) == 1:
            assert fetched == cost.total, (trial, name, ranges)
        else:  # overlapping ranges re-fetch shared chunks; the model counts each once
            assert cost.total <= fetched, (trial, name, ranges)
