"""``ucformat.deepspeed.load`` from an ``s3://`` store, inside real torchrun DeepSpeed jobs.

The stores live on the tests' own S3 server (moto, on 127.0.0.1; the ``s3`` fixture), with
small chunks and shards so that every rank reads many objects; the endpoint and credentials
reach the torchrun ranks through the environment, as botocore settings. Each load must restore
the engine bit for bit (the same checks as a load from a local store: tests/fixtures/
_ds_load_worker.py), each rank's bytes and requests must equal what the read-cost model plans
for its ranges, and the server must have seen exactly those requests from that rank (the
ranks tag their requests through botocore's ``AWS_SDK_UA_APP_ID``), and the manifest's GET
from the first rank only (it sends the bytes to the others). Where each rank read its own,
each rank fetched at least what it needed; where the load read once (the default
``read="auto"`` when ranks share chunks), the job fetched at least the chunks some rank needed
(these chunks are tiny, so the shard indexes weigh; the job-wide bound is test_read_once's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import S3_BUCKET
from tests.fixtures.load_cases import S3_LOADS
from tests.fixtures.run_loads import run_loads
from tests.s3server import Request, S3Server

pytestmark = pytest.mark.deepspeed

ROOT = "loads-s3"


@pytest.fixture(scope="module")
def s3_loads(
    ds_grid: Path, s3: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, dict[str, Any]], list[Request]]:
    """Every S3 load's result, and the requests the server received meanwhile."""
    s3.record()
    results = run_loads(
        S3_LOADS, ds_grid, tmp_path_factory.mktemp("s3-loads"), s3_root=f"s3://{S3_BUCKET}/{ROOT}"
    )
    return results, s3.recorded()


@pytest.mark.parametrize("name", [load.name for load in S3_LOADS])
def test_load_from_s3(s3_loads: tuple[dict[str, dict[str, Any]], list[Request]], name: str) -> None:
    results, requests = s3_loads
    result = results[name]
    assert result["failures"] == []
    store = f"{S3_BUCKET}/{ROOT}/{name}.ucf/"
    for rank, reported in enumerate(result["requests"]):
        gets = [
            r
            for r in requests
            if r.method == "GET"
            and r.key.startswith(store)
            and f"app/ucf-rank{rank}" in r.user_agent
        ]
        assert reported > 3, (rank, reported)  # small shards: many objects per rank
        manifest = 1 if rank == 0 else 0  # read by the first rank, sent to the others
        assert len(gets) == reported + manifest, (rank, len(gets), reported)
        if result["read_mode"] == "own":  # each rank fetched at least what it needed
            assert result["bytes_read"][rank] >= result["bytes_needed"][rank] > 0
    if result["read_mode"] == "once":  # the job fetched at least each needed chunk
        assert result["job_bytes_read"] == sum(result["bytes_read"])
        assert 0 < result["job_chunk_bytes_needed"] <= result["job_bytes_read"], result
