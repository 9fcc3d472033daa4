"""Benchmark live saves and distributed convert (docs/benchmarks.md, "Saving from the engine").

::

    python -m tests.bench.save_bench --size 30m --stages 1 3 --world-sizes 2 4 --work /tmp/sb

Per (stage, world size): one torchrun launch of :mod:`tests.bench._live_save_worker` times
``engine.save_checkpoint``, ``ucformat.deepspeed.save``, a plain copy of the rank's partitions
and ``save_async`` on the same engine. Then, on the native checkpoint it wrote: DeepSpeed's
``ds_to_universal`` (defaults), ``ucformat convert`` in one process, and ``torchrun
--nproc_per_node 2 -m ucformat_cli convert``. Every tool runs in the same session, one after
another, on the same machine; the source files are in the page cache (just written).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from tests.bench.cases import TAG, BenchCase
from tests.bench.measure import measure
from tests.launch import REPO_ROOT, torchrun_command

WORKER = Path(__file__).resolve().parent / "_live_save_worker.py"
CONVERT_WORKER = Path(__file__).resolve().parent / "_convert_worker.py"


def _env() -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _torchrun(world: int, *args: str) -> list[str]:
    return torchrun_command(world, args)


def bench_case(case: BenchCase, work: Path) -> dict[str, Any]:
    """Run the live-save worker, then the converters, for one case."""
    out = work / case.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    job = {"case": case.__dict__, "dir": str(out), "result": str(out / "result.json")}
    (out / "job.json").write_text(json.dumps(job))
    stats = measure(
        _torchrun(case.world_size, str(WORKER), "--jobs", str(out / "job.json")),
        env=_env(), cwd=REPO_ROOT, log=out / "worker.log", timeout_s=3600,
    )  # fmt: skip
    if stats.returncode != 0:
        raise RuntimeError(f"{case.name}: worker failed, see {out / 'worker.log'}")
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    native = out / "native" / TAG
    tools = {
        "ds_to_universal": [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                            "--input_folder", str(native),
                            "--output_folder", str(out / "universal")],
        "convert_1proc": [sys.executable, "-m", "ucformat_cli", "convert", str(native),
                          str(out / "c1.ucf"), "-q"],
        "convert_2proc": _torchrun(2, "-m", "ucformat_cli", "convert", str(native),
                                   str(out / "c2.ucf"), "-q"),
    }  # fmt: skip
    for world in (1, 2):  # the conversion alone, timed inside the job
        timing = out / f"convert_inside_{world}.json"
        measure(
            _torchrun(world, str(CONVERT_WORKER), str(native), str(out / f"i{world}.ucf"),
                      str(timing)),
            env=_env(), cwd=REPO_ROOT, log=out / f"inside_{world}.log", timeout_s=3600,
        )  # fmt: skip
        seconds = json.loads(timing.read_text())["seconds"] if timing.exists() else None
        result["times"][f"convert_inside_{world}proc"] = seconds
    for name, cmd in tools.items():
        run = measure(cmd, env=_env(), cwd=REPO_ROOT, log=out / f"{name}.log", timeout_s=3600)
        result["times"][name] = run.wall_s if run.returncode == 0 else None
        result.setdefault("peak_rss", {})[name] = run.peak_rss
    result["native_bytes"] = sum(p.stat().st_size for p in native.rglob("*") if p.is_file())
    result["store_bytes"] = sum(
        p.stat().st_size for p in (out / "live.ucf").rglob("*") if p.is_file()
    )
    for folder in ("native", "universal", "c1.ucf", "c2.ucf", "i1.ucf", "i2.ucf", "live.ucf",
                   "async.ucf"):  # fmt: skip
        shutil.rmtree(out / folder, ignore_errors=True)  # keep the disk free between cases
    return result


def table(results: list[dict[str, Any]]) -> str:
    """Markdown table of the results (seconds, slowest rank)."""
    head = (
        "| case | native GB | save_checkpoint | save | save_async blocked | copy floor "
        "| async total | save_checkpoint + ds_to_universal | convert 1 proc | convert 2 procs "
        "| inside: 1 proc | inside: 2 procs |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in results:
        t = r["times"]

        def s(key: str, t: dict[str, Any] = t) -> str:
            value = t.get(key)
            return "failed" if value is None else f"{value:.2f}"

        total = (
            f"{t['save_checkpoint'] + t['ds_to_universal']:.2f}"
            if t.get("ds_to_universal") is not None
            else "failed"
        )
        lines.append(
            f"| {r['case']} | {r['native_bytes'] / 1e9:.2f} | {s('save_checkpoint')} | {s('save')} "
            f"| {s('save_async_blocked')} | {s('copy_floor')} | {s('async_total')} | {total} "
            f"| {s('convert_1proc')} | {s('convert_2proc')} | {s('convert_inside_1proc')} "
            f"| {s('convert_inside_2proc')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="30m")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args(argv)
    results = []
    for world in args.world_sizes:
        for stage in args.stages:
            result = bench_case(BenchCase(args.size, stage, world_size=world), args.work)
            print(json.dumps(result), flush=True)
            results.append(result)
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
