"""Read once, job-wide, then share: four kinds of W = 4 job on CPU/gloo, against ``read="own"``.

One torchrun launch (tests/fixtures/_read_once_worker.py) loads, with ``read="own"`` and with
``read="once"`` (from a local store, and from the tests' S3 server):

* a plain replicated model (an MLP whole on every rank), with and without optimizer;
* the same model under HSDP 2 x 2;
* a DeepSpeed ZeRO-3 engine of the same model at W = 4, from a store whose chunks (1 MiB,
  flat) are wider than a rank's piece of a matrix, so that own reads fetch the same chunks on
  every rank;
* a DeepSpeed AutoTP engine, tp 2 x dp 2, ZeRO-1 (replicated norms, tensor-parallel slices).

Checked per job: the loaded state is bit for bit the state ``own`` loaded; job-wide, the bytes
fetched from storage (the store layer's count, summed over the ranks) are at most 1.02x the
bytes the job needs, each needed byte counted once, and the OS agrees (``rchar`` of
``/proc/self/io`` per rank: the storage reads and nothing else of size); own reads fetch the
replicas' bytes again (more than 1.9x where every rank holds everything). From S3, every
rank's requests are the GETs the server logged from that rank for that store, and the
manifest is fetched by the first rank only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import ucformat
from tests.conftest import S3_BUCKET, deepspeed_available
from tests.fixtures._read_once_worker import LR, make_mlp
from tests.launch import launch_jobs
from tests.s3server import Request, S3Server

pytestmark = pytest.mark.deepspeed

WORKER = Path(__file__).resolve().parents[1] / "fixtures" / "_read_once_worker.py"
WORLD = 4
MIB = 1024 * 1024
#: Bytes of a rank's ``rchar`` that are not storage reads (Python and torch reading small
#: files of their own during a load); the loads read megabytes.
RCHAR_SLACK = 64 * 1024
#: The AutoTP engine last: it leaves DeepSpeed's tensor-parallel globals set for the process.
CASES = ("plain-opt", "plain-weights", "hsdp", "zero3", "ds-tp")


def _mlp_store(path: str, **chunking: int) -> None:
    """The worker's MLP after one AdamW step, saved in one process."""
    model = make_mlp(1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model(
        torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    ).square().mean().backward()
    optimizer.step()
    ucformat.torch.save(model, optimizer, path, overwrite=True, fsync=False, **chunking)


def _stores(root: Path, s3_root: str) -> dict[str, tuple[str, str]]:
    """Per job, its store: a local folder and a copy on the S3 server."""
    from tests.fixtures.autotp_cases import SAVES, generate_autotp

    tp_case = next(case for case in SAVES if case.name == "tp2dp2-z1-bf16")
    autotp = generate_autotp((tp_case,))
    stores: dict[str, tuple[str, str]] = {}
    for name in ("mlp", "mlp-wide-chunks", "ds-tp"):
        local, remote = str(root / f"{name}.ucf"), f"{s3_root}/{name}.ucf"
        for where in (local, remote):
            if name == "mlp":
                _mlp_store(where)
            elif name == "mlp-wide-chunks":  # a ZeRO-3 piece is a quarter of a matrix's chunk
                _mlp_store(where, chunk_bytes=MIB, shard_bytes=2 * MIB)
            else:
                ucformat.convert(autotp[tp_case.name] / "ckpt", where, overwrite=True)
        stores[name] = (local, remote)
    return stores


@pytest.fixture(scope="module")
def once_runs(
    s3: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, tuple[str, str]], list[Request]]:
    """Every rank's records of every job, each job's stores (local, S3), the S3 requests."""
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    work = tmp_path_factory.mktemp("read-once")
    stores = _stores(work, f"s3://{S3_BUCKET}/read-once")
    jobs, used = [], {}
    for name in CASES:
        kind = {"plain-opt": "plain", "plain-weights": "plain", "ds-tp": "ds_tp"}.get(name, name)
        store = {"zero3": "mlp-wide-chunks", "ds-tp": "ds-tp"}.get(name, "mlp")
        local, remote = used[name] = stores[store]
        jobs.append({"kind": kind, "optimizer": name != "plain-weights", "store": local,
                     "s3": remote, "result": str(work / name)})  # fmt: skip
    jobs.append({"kind": "open", "store": stores["mlp"][0], "missing": str(work / "none.ucf"),
                 "result": str(work / "open")})  # fmt: skip
    s3.record()
    launch_jobs(WORKER, WORLD, jobs, work / "_launch", "read-once", timeout_s=900)
    records = {
        name: [json.loads((work / f"{name}.rank{r}.json").read_text()) for r in range(WORLD)]
        for name in [*CASES, "open"]
    }
    return records, used, s3.recorded()


Runs = tuple[dict[str, list[dict[str, Any]]], dict[str, tuple[str, str]], list[Request]]


def _needed_once(store: str, with_optimizer: bool) -> int:
    """Bytes of every array the job loads, each once (every element is needed by some rank)."""
    manifest = ucformat.open(store).manifest
    keys = set(manifest.optimizer.state_keys) if with_optimizer and manifest.optimizer else set()
    total = sum(buffer.array.nbytes for buffer in manifest.buffers.values())
    for entry in manifest.params.values():
        total += sum(
            ref.nbytes
            for key, ref in entry.states.items()
            if key in ("fp32", "value") or key in keys
        )
    return total


@pytest.mark.parametrize("name", CASES)
def test_read_once_reads_each_byte_once(once_runs: Runs, name: str) -> None:
    records, stores, _ = once_runs
    needed = _needed_once(stores[name][0], name != "plain-weights")
    once = [r["once"] for r in records[name]]
    own = [r["own"] for r in records[name]]
    assert all(r["read_mode"] == "once" for r in once)
    assert [r["same_as_own"] for r in once] == [True] * WORLD
    fetched = once[0]["job_bytes_read"]
    assert fetched == sum(r["bytes_read"] for r in once)
    assert fetched <= 1.02 * needed, (fetched, needed)
    # the OS saw the same storage reads: rchar counts the preadv of every chunk, and exchanged
    # bytes come over sockets (recv), which it does not count
    for record in once:
        assert record["bytes_read"] <= record["rchar"] <= record["bytes_read"] + RCHAR_SLACK
    assert sum(r["rchar"] for r in once) <= 1.02 * needed + WORLD * RCHAR_SLACK
    assert once[0]["job_bytes_exchanged"] == sum(r["bytes_sent"] for r in once)
    assert sum(r["bytes_sent"] for r in once) == sum(r["bytes_received"] for r in once)
    assert all(r["bytes_received"] > 0 for r in once)
    # own reads fetch what several ranks need once per rank
    assert all(r["read_mode"] == "own" for r in own)
    assert sum(r["bytes_read"] for r in own) >= 1.5 * fetched


@pytest.mark.parametrize("name", CASES)
def test_read_once_from_s3(once_runs: Runs, name: str) -> None:
    records, stores, _ = once_runs
    needed = _needed_once(stores[name][0], name != "plain-weights")
    s3 = [r["s3"] for r in records[name]]
    assert [r["same_as_own"] for r in s3] == [True] * WORLD
    assert s3[0]["job_bytes_read"] <= 1.02 * needed
    assert s3[0]["job_bytes_read"] == records[name][0]["once"]["job_bytes_read"]


def test_read_once_requests_are_the_servers(once_runs: Runs) -> None:
    """Each rank's requests, summed over the jobs that read a store, are the GETs the server
    logged from that rank for that store, plus, on the first rank, one manifest read per job
    (the loads open the S3 store themselves: the first rank reads the manifest and sends it)."""
    records, stores, requests = once_runs
    by_store: dict[str, list[str]] = {}
    for name in CASES:
        by_store.setdefault(stores[name][1], []).append(name)
    for remote, names in by_store.items():
        prefix = remote.removeprefix("s3://") + "/"
        for rank in range(WORLD):
            gets = [
                r
                for r in requests
                if r.method == "GET"
                and r.key.startswith(prefix)
                and f"app/ucf-once-rank{rank}" in r.user_agent
            ]
            reported = sum(records[name][rank]["s3"]["requests"] for name in names)
            manifests = len(names) if rank == 0 else 0
            assert len(gets) == reported + manifests, (remote, rank, len(gets), reported)


def test_the_first_rank_reads_the_manifest_and_sends_it(once_runs: Runs) -> None:
    """A collective open: every rank's manifest is the one it opens alone; where the first
    rank cannot read its store, it raises its own error and the others read theirs."""
    records = once_runs[0]["open"]
    assert [r["same"] for r in records] == [True] * WORLD
    assert [r["fallback"] for r in records] == ["SourceNotFoundError"] + ["opened"] * (WORLD - 1)
