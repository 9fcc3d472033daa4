"""Benchmark ucformat against DeepSpeed's own tools on real DeepSpeed checkpoints (CPU).

Run from the repository root (not part of the test suite)::

    python -m tests.bench.run_bench --cache /tmp/ucf_dsbench [--sizes 100m,300m] [--stages 1,3]
        [--repeat 3] [--load-sizes 100m] [--load-world-sizes 2,4] [--markdown OUT.md]

For every checkpoint (ZeRO-1 and ZeRO-3, bf16, saved at world size 2 by
:mod:`tests.bench._save_worker`, cached under ``--cache`` by fingerprint):

1. **convert**: ``cp -r`` of the tag folder (the floor), ``ucformat convert`` (the console
   script, end to end) and ``python -m deepspeed.checkpoint.ds_to_universal`` (its defaults), each
   ``--repeat`` times, interleaved in a rotating order. Before every run: ``sync`` (no dirty
   pages left from the previous one) and a read of the whole source (warm page cache: every
   contender starts from the same state). Measured: wall time, peak memory of the process tree
   (:mod:`tests.bench.measure`), peak and final disk of the output folder (temporary disk =
   peak - final). Medians are reported.
2. **inspect**: ``ucformat inspect STORE`` end to end, and the same work in-process.
3. **load** (checkpoints in ``--load-sizes``): at each world size, four torchrun launches of
   :mod:`tests.bench._load_worker`, each a fresh job doing one load, in the order DeepSpeed's
   ``load_universal`` (from the ``ds_to_universal`` output), ``ucformat.deepspeed.load`` (from
   the store), ucformat, DeepSpeed; per rank: wall time, bytes read, and a digest of the loaded
   state (every load must give the same).
4. **scale**: the simulated read amplification at W = 8..4096 (:mod:`tests.bench.scale`).

Prints the results and the ratios against the targets, and writes them as markdown (for
docs/benchmarks.md) and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from tests.bench.cases import TAG, BenchCase
from tests.bench.checkpoints import ensure_checkpoint
from tests.bench.measure import RunStats, measure, tree_size
from tests.launch import log_excerpt, run_in_group, torchrun_command

LOAD_WORKER = Path(__file__).resolve().parent / "_load_worker.py"
REPO_ROOT = Path(__file__).resolve().parents[2]
GIB = 1024**3
MIB = 1024**2
CONTENDERS = ("cp", "ucformat", "ds_to_universal")
LOAD_ORDER = ("ds", "ucf", "ucf", "ds")


# --------------------------------------------------------------------------------------
# Environment


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    memory = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            memory = int(line.split()[1]) * 1024
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
         if ln.startswith("model name")), platform.processor(),
    )  # fmt: skip

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    return {
        "date": subprocess.run(["date"], capture_output=True, text=True).stdout.strip(),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(memory / GIB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "deepspeed": version("deepspeed"),
        "zarr": version("zarr"),
        "ucformat": version("ucformat"),
        "load_average": os.getloadavg(),
    }


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def warm(*paths: Path) -> None:
    """Read every file under ``paths`` once (page cache), in 8 MiB blocks."""
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            with path.open("rb", buffering=0) as handle:
                while handle.read(8 * MIB):
                    pass


def sync() -> None:
    """Write back dirty pages (so one contender's writes do not slow the next)."""
    os.sync()


# --------------------------------------------------------------------------------------
# Convert


def _ucformat_exe() -> str:
    found = shutil.which("ucformat", path=str(Path(sys.executable).parent))
    return found or "ucformat"


def convert_cmd(tool: str, src: Path, out: Path) -> list[str]:
    """The command line of ``tool`` converting ``src`` into ``out``."""
    if tool == "cp":
        return ["cp", "-r", str(src), str(out)]
    if tool == "ucformat":
        return [_ucformat_exe(), "convert", str(src), str(out), "-q"]
    if tool == "ds_to_universal":
        universal = str(out / f"{TAG}_universal")
        return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                "--input_folder", str(src), "--output_folder", universal]  # fmt: skip
    raise ValueError(tool)


def bench_convert(src: Path, work: Path, repeat: int, log_dir: Path) -> dict[str, list[RunStats]]:
    """Run every contender ``repeat`` times; keep the last ucformat and ds outputs in ``work``."""
    runs: dict[str, list[RunStats]] = {tool: [] for tool in CONTENDERS}
    for rep in range(repeat):
        order = CONTENDERS[rep % 3 :] + CONTENDERS[: rep % 3]
        for tool in order:
            out = work / tool
            shutil.rmtree(out, ignore_errors=True)
            sync()
            warm(src)
            stats = measure(
                convert_cmd(tool, src, out), watch=out, env=_env(),
                log=log_dir / f"{tool}-{rep}.log",
            )  # fmt: skip
            if stats.returncode != 0:
                raise RuntimeError(
                    f"{tool} failed ({stats.returncode}); log: {log_dir / f'{tool}-{rep}.log'}"
                )
            runs[tool].append(stats)
            print(f"    {tool:16s} rep {rep}: {stats.wall_s:7.2f} s, "
                  f"max RSS {stats.max_rss / MIB:6.0f} MiB, tree PSS {stats.peak_pss / MIB:6.0f} "
                  f"MiB, temp disk {stats.temp_disk / MIB:6.0f} MiB", flush=True)  # fmt: skip
            if tool == "cp" or rep < repeat - 1:
                shutil.rmtree(out, ignore_errors=True)
    sync()
    return runs


def summarize_convert(runs: dict[str, list[RunStats]]) -> dict[str, dict[str, float]]:
    """Median of each measure per contender."""

    def med(values: list[float]) -> float:
        return float(statistics.median(values))

    return {
        tool: {
            "wall_s": med([r.wall_s for r in stats]),
            "wall_min_s": min(r.wall_s for r in stats),
            "wall_max_s": max(r.wall_s for r in stats),
            "max_rss": med([r.max_rss for r in stats]),
            "peak_pss": med([r.peak_pss for r in stats]),
            "temp_disk": med([r.temp_disk for r in stats]),
            "final_disk": med([r.final_disk for r in stats]),
        }
        for tool, stats in runs.items()
    }


# --------------------------------------------------------------------------------------
# Inspect


_INSPECT_IN_PROCESS = """
import contextlib, io, sys, time
from ucformat_cli.main import app
started = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()):
    try:
        app(["inspect", sys.argv[1]])
    except SystemExit as exit:
        assert exit.code in (0, None), exit.code
print(time.perf_counter() - started)
"""


def bench_inspect(store: Path, repeat: int) -> dict[str, float]:
    """``ucformat inspect`` end to end (median of ``repeat``) and the in-process work."""
    walls = []
    for _ in range(repeat):
        stats = measure([_ucformat_exe(), "inspect", str(store)], env=_env())
        if stats.returncode != 0:
            raise RuntimeError(f"ucformat inspect {store} failed")
        walls.append(stats.wall_s)
    inner = []
    for _ in range(repeat):
        done = subprocess.run(
            [sys.executable, "-c", _INSPECT_IN_PROCESS, str(store)],
            capture_output=True, text=True, env=_env(), check=True,
        )  # fmt: skip
        inner.append(float(done.stdout.strip().splitlines()[-1]))
    imports = []
    for _ in range(repeat):
        stats = measure([sys.executable, "-c", "import ucformat_cli.main"], env=_env())
        imports.append(stats.wall_s)
    return {
        "cli_s": float(statistics.median(walls)),
        "in_process_s": float(statistics.median(inner)),
        "cli_import_s": float(statistics.median(imports)),
    }


# --------------------------------------------------------------------------------------
# Load


def bench_load(
    case: BenchCase, ds_dir: Path, store: Path, world_size: int, work: Path
) -> dict[str, Any]:
    """Launches at ``world_size``, one load each (ds, ucf, ucf, ds); per-rank numbers.

    Each load runs in a fresh job, as a resuming job loads once: neither loader inherits the
    other's warm-up (imports, allocator, first touch of memory).
    """
    ranks: list[list[dict[str, Any]]] = [[] for _ in range(world_size)]
    for index, loader in enumerate(LOAD_ORDER):
        result = work / f"load-ws{world_size}-{index}.json"
        job = work / f"load-ws{world_size}-{index}-job.json"
        job.write_text(json.dumps({
            "case": case.__dict__, "ds_dir": str(ds_dir), "store": str(store),
            "order": [loader], "result": str(result),
        }))  # fmt: skip
        sync()
        warm(ds_dir, store)
        log = work / f"load-ws{world_size}-{index}.log"
        status = run_in_group(
            torchrun_command(world_size, [str(LOAD_WORKER), "--jobs", str(job)]),
            timeout_s=900.0,
            log_path=log,
        ).returncode
        if status != 0:
            raise RuntimeError(f"load launch ws={world_size} failed ({status}); log {log}\n"
                               f"{log_excerpt(log)}")  # fmt: skip
        for rank, rows in enumerate(json.loads(result.read_text())["ranks"]):
            ranks[rank] += rows
    out: dict[str, Any] = {"world_size": world_size}
    for loader in ("ds", "ucf"):
        rows = [[row for row in rank if row["loader"] == loader] for rank in ranks]
        out[loader] = {
            "seconds_per_rank": [statistics.mean(r["seconds"] for r in rs) for rs in rows],
            "job_seconds": statistics.mean(
                max(rs[i]["job_seconds"] for rs in rows) for i in range(len(rows[0]))
            ),
            "runs_seconds": [[r["seconds"] for r in rs] for rs in rows],
            "rchar_per_rank": [rs[-1]["rchar"] for rs in rows],
            "torch_load_bytes_per_rank": [rs[-1]["torch_load_bytes"] for rs in rows],
        }
        if loader == "ucf":
            out[loader]["store_bytes_per_rank"] = [rs[-1]["store_bytes_read"] for rs in rows]
            out["bytes_needed_per_rank"] = [rs[-1]["bytes_needed"] for rs in rows]
    out["same_state"] = all(len({row["digest"] for row in rank}) == 1 for rank in ranks)
    return out


# --------------------------------------------------------------------------------------
# Report


def _gb(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def _mark(ok: bool) -> str:
    return "pass" if ok else "**miss**"


def targets(results: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """(target, checkpoint, measured, ok) rows."""
    rows: list[tuple[str, str, str, bool]] = []
    by_name = results["checkpoints"]
    for name, entry in by_name.items():
        conv = entry["convert"]
        ucf, ds, cp = conv["ucformat"], conv["ds_to_universal"], conv["cp"]
        speedup = ds["wall_s"] / ucf["wall_s"]
        rows.append(("convert >= 10x faster than ds_to_universal", name,
                     f"{speedup:.1f}x ({ds['wall_s']:.1f} s vs {ucf['wall_s']:.1f} s)",
                     speedup >= 10))  # fmt: skip
        over_cp = ucf["wall_s"] / cp["wall_s"]
        rows.append(("convert <= 3x `cp -r`", name,
                     f"{over_cp:.1f}x ({ucf['wall_s']:.1f} s vs {cp['wall_s']:.2f} s)",
                     over_cp <= 3))  # fmt: skip
        share = ucf["max_rss"] / entry["size"]
        rows.append(("convert peak RSS <= 25% of checkpoint", name,
                     f"{100 * share:.1f}% ({_gb(ucf['max_rss'])} of {_gb(entry['size'])})",
                     share <= 0.25))  # fmt: skip
        if "inspect" in entry:
            cli = entry["inspect"]["cli_s"]
            rows.append(("`ucformat inspect` < 0.5 s", name, f"{cli:.2f} s", cli < 0.5))
        for load in entry.get("loads", []):
            world = load["world_size"]
            needed = sum(load["bytes_needed_per_rank"])
            fetched = sum(load["ucf"]["store_bytes_per_rank"])
            rows.append((f"load bytes read <= 1.1x needed (W={world})", name,
                         f"{fetched / needed:.3f}x", fetched / needed <= 1.1))  # fmt: skip
            ratio = load["ucf"]["job_seconds"] / load["ds"]["job_seconds"]
            rows.append((f"load wall <= 0.5x DeepSpeed's (W={world})", name,
                         f"{ratio:.2f}x ({load['ucf']['job_seconds']:.2f} s vs "
                         f"{load['ds']['job_seconds']:.2f} s)", ratio <= 0.5))  # fmt: skip
    for stage in (1, 3):
        pairs = [(n, e) for n, e in by_name.items() if e["stage"] == stage]
        small = [e for n, e in pairs if e["size_name"] == "100m"]
        large = [e for n, e in pairs if e["size_name"] == "300m"]
        if small and large:
            a = small[0]["convert"]["ucformat"]["max_rss"]
            b = large[0]["convert"]["ucformat"]["max_rss"]
            rows.append(("convert RSS grows < 10% when the checkpoint triples", f"ZeRO-{stage}",
                         f"{100 * (b / a - 1):+.1f}% ({_gb(a)} -> {_gb(b)})",
                         b / a - 1 < 0.10))  # fmt: skip
    for row in results.get("scale_w512", []):
        rows.append(("simulated amplification <= 1.25x at W=512",
                     f"{row['model']} ZeRO-{row['stage']}", f"{row['value']:.3f}x",
                     row["value"] <= 1.25))  # fmt: skip
    return rows


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown tables (for docs/benchmarks.md)."""
    m = results["machine"]
    lines = [
        f"Measured {m['date']} on {m['nproc']} CPU cores ({m['cpu']}), {m['memory_gib']} GiB "
        f"RAM, Linux {m['kernel']}; Python {m['python']}, torch {m['torch']}, deepspeed "
        f"{m['deepspeed']}, zarr {m['zarr']}, ucformat {m['ucformat']}. Load average (1, 5, 15 "
        "min) at start: "
        + ", ".join(f"{x:.2f}" for x in m["load_average"])
        + "; at end: "
        + ", ".join(f"{x:.2f}" for x in m.get("load_average_end", ()))
        + ". Command: `"
        + results["command"]
        + "`.",
        "",
        "### Convert (median of "
        f"{results['repeat']} runs each, same warm source, `sync` before each run)",
        "",
        "| checkpoint | size | tool | wall | (min - max) | max RSS | tree PSS | temp disk "
        "| output |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["checkpoints"].items():
        for tool in CONTENDERS:
            s = entry["convert"][tool]
            lines.append(
                f"| {name} | {_gb(entry['size'])} | {tool} | {s['wall_s']:.2f} s | "
                f"{s['wall_min_s']:.2f} - {s['wall_max_s']:.2f} s | "
                f"{_gb(s['max_rss'])} | {_gb(s['peak_pss'])} | {_gb(s['temp_disk'])} | "
                f"{_gb(s['final_disk'])} |"
            )
    lines += [
        "",
        "### Inspect",
        "",
        "| checkpoint | `ucformat inspect` (CLI) | of which "
        "`import ucformat_cli.main` | the command in-process, after the imports |",
        "|---|---|---|---|",
    ]
    for name, entry in results["checkpoints"].items():
        if "inspect" in entry:
            i = entry["inspect"]
            lines.append(f"| {name} | {i['cli_s']:.2f} s | {i['cli_import_s']:.2f} s | "
                         f"{1000 * i['in_process_s']:.0f} ms |")  # fmt: skip
    lines += ["", "### Load (per rank; mean of 2 fresh jobs each, in the order ds, ucf, ucf, ds)",
              "",
              "| checkpoint | W | loader | seconds per rank | job seconds | bytes read per rank "
              "| needed per rank | read / needed (all ranks) | same state |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, entry in results["checkpoints"].items():
        for load in entry.get("loads", []):
            needed = load["bytes_needed_per_rank"]
            for loader, label in (("ds", "DeepSpeed load_universal"),
                                  ("ucf", "ucformat.deepspeed.load")):  # fmt: skip
                d = load[loader]
                read = d.get("store_bytes_per_rank", d["rchar_per_rank"])
                lines.append(
                    f"| {name} | {load['world_size']} | {label} | "
                    + ", ".join(f"{s:.2f}" for s in d["seconds_per_rank"])
                    + f" | {d['job_seconds']:.2f} | "
                    + ", ".join(_gb(b) for b in read)
                    + " | "
                    + ", ".join(_gb(b) for b in needed)
                    + f" | {sum(read) / sum(needed):.2f}x | "
                    + ("yes" if load["same_state"] else "**NO**")
                    + " |"
                )
    lines += ["", "### Targets", "", "| target | on | measured | |", "|---|---|---|---|"]
    lines += [f"| {t} | {on} | {value} | {_mark(ok)} |" for t, on, value, ok in targets(results)]
    if "scale_markdown" in results:
        lines += ["", "### Simulated scale (fp32 state; fetched / needed bytes, all ranks)", "",
                  results["scale_markdown"]]  # fmt: skip
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="checkpoints and scratch")
    parser.add_argument("--sizes", default="100m,300m")
    parser.add_argument("--stages", default="1,3")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--load-sizes", default="100m", help="'' for no load benchmark")
    parser.add_argument("--load-world-sizes", default="2,4")
    parser.add_argument("--no-scale", action="store_true", help="skip the simulated table")
    parser.add_argument("--markdown", type=Path, help="default: CACHE/results.md")
    parser.add_argument("--json", type=Path, help="default: CACHE/results.json")
    args = parser.parse_args(argv)
    cache = args.cache.resolve()
    sizes = [s for s in args.sizes.split(",") if s]
    stages = [int(s) for s in args.stages.split(",") if s]
    load_sizes = {s for s in args.load_sizes.split(",") if s}
    world_sizes = [int(w) for w in args.load_world_sizes.split(",") if w]
    results: dict[str, Any] = {
        "machine": machine(), "repeat": args.repeat, "checkpoints": {},
        "command": "python -m tests.bench.run_bench " + " ".join(argv or sys.argv[1:]),
    }  # fmt: skip
    cases = [BenchCase(size, stage) for size in sizes for stage in stages]
    sources = {case.name: ensure_checkpoint(case, cache / "ckpts") for case in cases}
    print("[bench] warming imports", flush=True)
    for code in ("import ucformat_cli.main", "import deepspeed.checkpoint.ds_to_universal"):
        subprocess.run([sys.executable, "-c", code], env=_env(), check=True,
                       capture_output=True)  # fmt: skip
    for case in cases:
        src = sources[case.name]
        work = cache / "work" / case.name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        size = tree_size(src)
        print(f"[bench] {case.name}: {_gb(size)} ({case.model.numel / 1e6:.0f}M params)",
              flush=True)  # fmt: skip
        entry: dict[str, Any] = {"size": size, "stage": case.stage, "size_name": case.size,
                                 "params": case.model.numel}  # fmt: skip
        started = time.monotonic()
        runs = bench_convert(src, work, args.repeat, work)
        entry["convert"] = summarize_convert(runs)
        entry["convert_runs"] = {t: [r.to_dict() for r in rs] for t, rs in runs.items()}
        print(f"  convert done in {time.monotonic() - started:.0f} s", flush=True)
        store = work / "ucformat"
        entry["inspect"] = bench_inspect(store, args.repeat)
        print(f"  inspect: {entry['inspect']}", flush=True)
        if case.size in load_sizes:
            entry["loads"] = []
            for world_size in world_sizes:
                started = time.monotonic()
                load = bench_load(case, work / "ds_to_universal", store, world_size, work)
                entry["loads"].append(load)
                print(f"  load W={world_size} in {time.monotonic() - started:.0f} s: "
                      f"ds {load['ds']['job_seconds']:.2f} s, "
                      f"ucf {load['ucf']['job_seconds']:.2f} s, "
                      f"same state: {load['same_state']}", flush=True)  # fmt: skip
        shutil.rmtree(work / "ucformat", ignore_errors=True)
        shutil.rmtree(work / "ds_to_universal", ignore_errors=True)
        results["checkpoints"][case.name] = entry
    if not args.no_scale:
        from tests.bench import scale

        started = time.monotonic()
        rows = scale.table()
        results["scale"] = rows
        results["scale_markdown"] = scale.markdown(rows)
        default = scale.policy_name(scale.POLICIES[0])
        results["scale_w512"] = [
            {"model": r["model"], "stage": r["stage"], "value": r["W=512"]}
            for r in rows if r["policy"] == default
        ]  # fmt: skip
        print(f"[bench] scale table in {time.monotonic() - started:.0f} s", flush=True)
    results["machine"]["load_average_end"] = os.getloadavg()
    text = markdown(results)
    print(text)
    (args.markdown or cache / "results.md").write_text(text)
    (args.json or cache / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
