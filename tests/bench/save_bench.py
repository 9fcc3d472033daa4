"""Benchmark live saves and distributed convert (docs/benchmarks.md, "Saving from the engine").

::

    python -m tests.bench.save_bench --size 30m --stages 1 3 --world-sizes 2 4 --work /tmp/sb
    python -m tests.bench.save_bench --size 100m --repeat 3 --no-convert --fsdp --work /tmp/sb

Per (stage, world size): one torchrun launch of :mod:`tests.bench._live_save_worker` times
``engine.save_checkpoint``, ``ucformat.deepspeed.save``, a plain copy of the rank's partitions
and ``save_async`` on the same engine. Then, on the native checkpoint it wrote: DeepSpeed's
``ds_to_universal`` (defaults), ``ucformat convert`` in one process, and ``torchrun
--nproc_per_node 2 -m ucformat_cli convert``. Every tool runs in the same session, one after
another, on the same machine; the source files are in the page cache (just written).

``--repeat N``: every pair (``save_checkpoint`` / ``save``, copy floor / ``save_async``) runs N
times in alternating order on the same engine; the table gives medians and ratios. Each save's
destination follows ``--protocol`` (:mod:`tests.bench.destinations`): ``fresh`` (default), a new
destination after ``os.sync``, nothing deleted while a launch runs, and each launch waits a
minute after the previous one's files were deleted; ``delete``, one destination per kind emptied
just before each save (the tables before stop 25). ``--s3`` also saves each engine with ``save`` and
``save_async`` to moto's local S3 server (:mod:`tests.s3server`; it holds the objects in
memory, so keep the model small). ``--no-convert`` skips the converters; ``--fsdp`` adds, per
world size, ``ucformat.torch.save`` against ``dcp.save`` of the same FSDP2 state
(:mod:`tests.bench._fsdp_save_worker`). The load average is recorded before and after each
launch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from tests.bench.cases import TAG, BenchCase
from tests.bench.destinations import PROTOCOLS, remove_outputs
from tests.bench.measure import measure
from tests.launch import REPO_ROOT, torchrun_command

WORKER = Path(__file__).resolve().parent / "_live_save_worker.py"
CONVERT_WORKER = Path(__file__).resolve().parent / "_convert_worker.py"
FSDP_WORKER = Path(__file__).resolve().parent / "_fsdp_save_worker.py"


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _env() -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _torchrun(world: int, *args: str) -> list[str]:
    return torchrun_command(world, args)


#: What a live-save launch leaves in its case folder (each also as ``<name>-<i>``).
SAVE_OUTPUTS = ("native", "live.ucf", "async.ucf")


def bench_case(
    case: BenchCase,
    work: Path,
    *,
    repeat: int = 1,
    convert: bool = True,
    s3: str | None = None,
    protocol: str = "fresh",
    not_before: float = 0.0,
) -> dict[str, Any]:
    """Run the live-save worker, then (``convert``) the converters, for one case; the result
    carries ``not_before`` for the next launch (:func:`tests.bench.destinations.remove_outputs`).
    """
    out = work / case.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    job = {"case": case.__dict__, "dir": str(out), "result": str(out / "result.json"),
           "repeat": repeat, "s3": f"{s3}/{case.name}" if s3 else None,
           "protocol": protocol, "not_before": not_before}  # fmt: skip
    (out / "job.json").write_text(json.dumps(job))
    load_before = _load()
    stats = measure(
        _torchrun(case.world_size, str(WORKER), "--jobs", str(out / "job.json")),
        env=_env(), cwd=REPO_ROOT, log=out / "worker.log", timeout_s=3600,
    )  # fmt: skip
    if stats.returncode != 0:
        raise RuntimeError(f"{case.name}: worker failed, see {out / 'worker.log'}")
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    result["load"] = [load_before, _load()]
    native = out / "native" / TAG
    result["native_bytes"] = sum(p.stat().st_size for p in native.rglob("*") if p.is_file())
    result["store_bytes"] = sum(
        p.stat().st_size for p in (out / "live.ucf").rglob("*") if p.is_file()
    )
    if not convert:
        result["not_before"] = remove_outputs(out, SAVE_OUTPUTS)
        return result
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
    for folder in ("universal", "c1.ucf", "c2.ucf", "i1.ucf", "i2.ucf"):
        shutil.rmtree(out / folder, ignore_errors=True)  # keep the disk free between cases
    result["not_before"] = remove_outputs(out, SAVE_OUTPUTS)
    return result


def bench_fsdp(
    size: str,
    world: int,
    work: Path,
    *,
    repeat: int,
    protocol: str = "fresh",
    not_before: float = 0.0,
) -> dict[str, Any]:
    """``ucformat.torch.save`` vs ``dcp.save`` of one FSDP2 state at ``world`` ranks."""
    out = work / f"fsdp-{size}-ws{world}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    job = {"size": size, "dir": str(out), "result": str(out / "result.json"), "repeat": repeat,
           "protocol": protocol, "not_before": not_before}  # fmt: skip
    (out / "job.json").write_text(json.dumps(job))
    load_before = _load()
    stats = measure(
        _torchrun(world, str(FSDP_WORKER), "--jobs", str(out / "job.json")),
        env=_env(), cwd=REPO_ROOT, log=out / "worker.log", timeout_s=3600,
    )  # fmt: skip
    if stats.returncode != 0:
        raise RuntimeError(f"fsdp {size} ws{world}: worker failed, see {out / 'worker.log'}")
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    result["load"] = [load_before, _load()]
    result["not_before"] = remove_outputs(out, ("fsdp.ucf", "fsdp.dcp"))  # what the worker saved
    return result


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def pairs_table(results: list[dict[str, Any]], fsdp: list[dict[str, Any]]) -> str:
    """The side-by-side table: medians of the interleaved pairs, ratios, load averages."""
    lines = [
        "| case | load avg (1 min) before / after | save_checkpoint | save "
        "| save / save_checkpoint | copy floor | save_async blocked | blocked / copy floor "
        "| async total |",
        "|" + "---|" * 9,
    ]
    for r in results:
        t, runs = r["times"], r["runs"]
        lines.append(
            f"| {r['case']} | {r['load'][0][0]:.1f} / {r['load'][1][0]:.1f} "
            f"| {t['save_checkpoint']:.2f} ({_spread(runs['save_checkpoint'])}) "
            f"| {t['save']:.2f} ({_spread(runs['save'])}) "
            f"| **{t['save'] / t['save_checkpoint']:.2f}x** "
            f"| {t['copy_floor']:.2f} ({_spread(runs['copy_floor'])}) "
            f"| {t['save_async_blocked']:.2f} ({_spread(runs['save_async_blocked'])}) "
            f"| **{t['save_async_blocked'] / t['copy_floor']:.2f}x** "
            f"| {t['async_total']:.2f} |"
        )
    lines += [
        "",
        "Like for like (same launch): both without fsync, and both with every file fsynced:",
        "",
        "| case | save (fsync=False) | save_checkpoint | ratio | save | save_checkpoint + fsync "
        "| ratio |",
        "|" + "---|" * 7,
    ]
    for r in results:
        t, runs = r["times"], r["runs"]
        if "save_nofsync" not in t:
            continue
        lines.append(
            f"| {r['case']} | {t['save_nofsync']:.2f} ({_spread(runs['save_nofsync'])}) "
            f"| {t['save_checkpoint']:.2f} "
            f"| **{t['save_nofsync'] / t['save_checkpoint']:.2f}x** "
            f"| {t['save']:.2f} "
            f"| {t['save_checkpoint_fsync']:.2f} ({_spread(runs['save_checkpoint_fsync'])}) "
            f"| **{t['save'] / t['save_checkpoint_fsync']:.2f}x** |"
        )
    for r in fsdp:
        t, runs = r["times"], r["runs"]
        if "dcp.save fsync" not in t:
            continue
        nofsync, durable = t["ucformat.torch.save nofsync"], t["dcp.save fsync"]
        lines.append(
            f"| {r['case']} (ucformat.torch.save / dcp.save) "
            f"| {nofsync:.2f} ({_spread(runs['ucformat.torch.save nofsync'])}) "
            f"| {t['dcp.save']:.2f} | **{nofsync / t['dcp.save']:.2f}x** "
            f"| {t['ucformat.torch.save']:.2f} "
            f"| {durable:.2f} ({_spread(runs['dcp.save fsync'])}) "
            f"| **{t['ucformat.torch.save'] / durable:.2f}x** |"
        )
    if fsdp:
        lines += [
            "",
            "| case | params | load avg (1 min) before / after | dcp.save | ucformat.torch.save "
            "| ucformat / dcp |",
            "|" + "---|" * 6,
        ]
        for r in fsdp:
            t, runs = r["times"], r["runs"]
            ucf, dcp = t["ucformat.torch.save"], t["dcp.save"]
            lines.append(
                f"| {r['case']} | {r['params'] / 1e6:.1f}M "
                f"| {r['load'][0][0]:.1f} / {r['load'][1][0]:.1f} "
                f"| {dcp:.2f} ({_spread(runs['dcp.save'])}) "
                f"| {ucf:.2f} ({_spread(runs['ucformat.torch.save'])}) | **{ucf / dcp:.2f}x** |"
            )
    return "\n".join(lines)


def s3_table(results: list[dict[str, Any]]) -> str:
    """``save`` against ``save_async`` to the local S3 server: medians (min-max)."""
    lines = [
        "| case | load avg (1 min) before / after | save (S3) | save_async blocked (S3) "
        "| blocked / save | async total (S3) |",
        "|" + "---|" * 6,
    ]
    for r in results:
        t, runs = r["times"], r["runs"]
        lines.append(
            f"| {r['case']} | {r['load'][0][0]:.1f} / {r['load'][1][0]:.1f} "
            f"| {t['s3_save']:.2f} ({_spread(runs['s3_save'])}) "
            f"| {t['s3_save_async_blocked']:.2f} ({_spread(runs['s3_save_async_blocked'])}) "
            f"| **{t['s3_save_async_blocked'] / t['s3_save']:.2f}x** "
            f"| {t['s3_async_total']:.2f} ({_spread(runs['s3_async_total'])}) |"
        )
    return "\n".join(lines)


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
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-convert", action="store_true")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--s3", action="store_true", help="also save to the local S3 server")
    parser.add_argument(
        "--protocol", choices=PROTOCOLS, default="fresh",
        help="fresh: every save to a new destination after os.sync, nothing deleted meanwhile; "
        "delete: one destination per kind, emptied just before each save (tests/bench/"
        "destinations.py)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    results, fsdp = [], []
    not_before = 0.0  # a launch after a deletion waits for the freed inodes to age
    with contextlib.ExitStack() as stack:
        s3 = None
        if args.s3:
            from tests.s3server import S3Server

            server = stack.enter_context(S3Server())
            server.create_bucket("ucf-save-bench")
            os.environ.update(server.env())
            s3 = "s3://ucf-save-bench"
        for world in args.world_sizes:
            for stage in args.stages:
                case = BenchCase(args.size, stage, world_size=world)
                result = bench_case(
                    case, args.work, repeat=args.repeat, convert=not args.no_convert, s3=s3,
                    protocol=args.protocol, not_before=not_before,
                )  # fmt: skip
                not_before = result["not_before"]
                print(json.dumps(result), flush=True)
                results.append(result)
            if args.fsdp:
                fsdp.append(bench_fsdp(args.size, world, args.work, repeat=args.repeat,
                                       protocol=args.protocol, not_before=not_before))  # fmt: skip
                not_before = fsdp[-1]["not_before"]
                print(json.dumps(fsdp[-1]), flush=True)
    (args.work / "results.json").write_text(json.dumps({"ds": results, "fsdp": fsdp}, indent=1))
    if not args.no_convert:
        print(table(results))
    print(pairs_table(results, fsdp))
    if args.s3:
        print(s3_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
