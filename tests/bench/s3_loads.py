"""Bytes and requests per rank of ``ucformat.deepspeed.load`` from a local S3 server (CPU).

Run from the repository root (not part of the test suite)::

    python -m tests.bench.s3_loads --cache /tmp/ucf_dsbench [--size 25m] [--stages 1,3]
        [--world-sizes 2,4] [--markdown OUT.md]

For each ZeRO stage: the benchmark checkpoint (:mod:`tests.bench.checkpoints`, saved by
DeepSpeed at world size 2, cached) is converted once with the default chunking to a local
folder and once to ``s3://`` on moto's S3 server (``tests/s3server.py``, started here on
127.0.0.1 and stopped at the end). Then, at every world size, one torchrun launch of
:mod:`tests.bench._load_worker` loads the store into a fresh engine of the same stage, once
from the local folder and once from S3. Per rank: bytes fetched, requests (as the reader counts
them, and as the S3 server saw them: ``GET`` requests tagged with the rank through botocore's
``AWS_SDK_UA_APP_ID``), the read-cost model's plan, the bytes the rank needed and the wall time.
Every load must give the same state (digest) from either store.

DeepSpeed's own universal loader has no column: it reads local files only (``torch.load`` of
every whole per-parameter file on every rank); docs/benchmarks.md has its local numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ucformat
from tests.bench.cases import BenchCase
from tests.bench.checkpoints import ensure_checkpoint
from tests.launch import log_excerpt, run_in_group, torchrun_command
from tests.s3server import S3Server

LOAD_WORKER = Path(__file__).resolve().parent / "_load_worker.py"
BUCKET = "ucformat-bench"
TAG = "ucf-bench-rank"


def _launch(
    case: BenchCase, world_size: int, store: str, work: Path, label: str
) -> list[dict[str, Any]]:
    """One torchrun launch loading ``store`` once; the per-rank rows."""
    result = work / f"{label}.json"
    job = work / f"{label}-job.json"
    target = BenchCase(case.size, case.stage, world_size, case.dtype, case.steps)
    job.write_text(json.dumps({
        "case": target.__dict__, "ds_dir": "", "store": store, "order": ["ucf"],
        "result": str(result), "ua_tag": TAG,
    }))  # fmt: skip
    log = work / f"{label}.log"
    status = run_in_group(
        torchrun_command(world_size, [str(LOAD_WORKER), "--jobs", str(job)]),
        timeout_s=900.0,
        log_path=log,
    ).returncode
    if status != 0:
        raise RuntimeError(f"{label} failed ({status}); log {log}\n{log_excerpt(log)}")
    return [rows[0] for rows in json.loads(result.read_text())["ranks"]]


def bench(
    case: BenchCase, cache: Path, world_sizes: Sequence[int], server: S3Server, work: Path
) -> list[dict[str, Any]]:
    """Every world size's per-rank rows, local and S3, for ``case``'s checkpoint."""
    tag_dir = ensure_checkpoint(case, cache)
    local = work / f"{case.name}.ucf"
    remote = f"s3://{BUCKET}/{case.name}.ucf"
    ucformat.convert(tag_dir, local, overwrite=True)
    ucformat.convert(tag_dir, remote, overwrite=True)
    out = []
    for world_size in world_sizes:
        here = _launch(case, world_size, str(local), work, f"{case.name}-ws{world_size}-local")
        server.record()
        there = _launch(case, world_size, remote, work, f"{case.name}-ws{world_size}-s3")
        gets = [r for r in server.recorded() if r.method == "GET"]
        for rank, (mine, theirs) in enumerate(zip(here, there, strict=True)):
            seen = sum(1 for r in gets if f"app/{TAG}{rank}" in r.user_agent)
            out.append({
                "checkpoint": case.name, "world_size": world_size, "rank": rank,
                "needed": theirs["bytes_needed"],
                "local_bytes": mine["store_bytes_read"], "local_requests": mine["requests"],
                "local_s": mine["seconds"],
                "s3_bytes": theirs["store_bytes_read"], "s3_requests": theirs["requests"],
                "s3_server_gets": seen, "s3_s": theirs["seconds"],
                "planned_bytes": theirs["planned_bytes"],
                "planned_requests": theirs["planned_requests"],
                "same_state": mine["digest"] == theirs["digest"],
            })  # fmt: skip
    return out


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table for docs/benchmarks.md."""
    mib = 1024 * 1024
    lines = [
        "| checkpoint | W | rank | needed | local: bytes / requests / s | S3: bytes / requests "
        "(server GETs) / s | planned bytes / requests | same state |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['checkpoint']} | {r['world_size']} | {r['rank']} | "
            f"{r['needed'] / mib:.1f} MiB | {r['local_bytes'] / mib:.1f} MiB / "
            f"{r['local_requests']} / {r['local_s']:.2f} | {r['s3_bytes'] / mib:.1f} MiB / "
            f"{r['s3_requests']} ({r['s3_server_gets']}) / {r['s3_s']:.2f} | "
            f"{r['planned_bytes'] / mib:.1f} MiB / {r['planned_requests']} | "
            f"{'yes' if r['same_state'] else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="benchmark checkpoint cache")
    parser.add_argument("--size", default="25m")
    parser.add_argument("--stages", default="1,3")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ucf-s3-bench-") as tmp:
        work = Path(tmp)
        with S3Server(recording=work / "requests.jsonl") as server:
            server.create_bucket(BUCKET)
            os.environ.update(server.env())
            for stage in (int(s) for s in args.stages.split(",")):
                rows += bench(BenchCase(args.size, stage), args.cache, world_sizes, server, work)
    table = markdown(rows)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    ok = all(
        r["same_state"]
        and r["s3_requests"] == r["planned_requests"] == r["s3_server_gets"] - 1
        and r["s3_bytes"] == r["planned_bytes"]
        for r in rows
    )
    print(
        "every load: same state, requests and bytes as planned" if ok else "MISMATCH",
        file=sys.stderr,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
