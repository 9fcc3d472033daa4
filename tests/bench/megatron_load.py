"""Benchmark: a Megatron-Core job resuming at a new layout, ``ucformat.megatron.load`` from the
store vs Megatron's own ``dist_checkpointing.load`` of the ``fully_reshardable`` checkpoint.

Run from the repository root (not part of the test suite)::

    python -m tests.bench.megatron_load --work /tmp/ucf_mcorebench [--hidden 1024] [--ffn 2816]
        [--layers 2] [--vocab 8192] [--layouts tp4,tp2dp2,pp2tp2] [--repeat 1] [--markdown OUT]

1. **save** (one torchrun launch at TP=2): the fixture model of
   :mod:`tests.fixtures._megatron_worker` at these sizes (fp32, the distributed optimizer),
   one training step, saved as Megatron-LM does (``fully_reshardable``); converted into a store
   with ``ucformat.convert``. Every matrix is 1 MiB or more (fp32);
2. **load** (one torchrun launch per world size; every file is read once before, so every load
   starts with a warm page cache): per layout, fresh jobs alternating Megatron's own load and
   ``ucformat.megatron.load``. Per rank: seconds of the load, bytes read (``rchar`` delta of
   ``/proc/self/io``), ucformat's report (bytes fetched from the store, bytes the rank needs:
   its boxes of the weights and, of the distributed optimizer's state, its data-parallel
   shard), and a digest of everything the rank then holds (both loaders must agree).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from tests.fixtures.make_fixtures import launch_jobs
from tests.fixtures.megatron_cases import MegatronCase

WORKER = Path(__file__).resolve().parent / "_megatron_load_worker.py"
#: name -> (world size, tp, pp).
LAYOUTS = {
    "tp4": (4, 4, 1),
    "tp2dp2": (4, 2, 1),
    "pp2tp2": (4, 2, 2),
    "tp1dp4": (4, 1, 1),
    "tp2": (2, 2, 1),
    "tp1dp2": (2, 1, 1),
}


def _case(
    name: str, world_size: int, tp: int, pp: int, layers: int, model: dict[str, int]
) -> dict[str, Any]:
    case = dataclasses.asdict(
        MegatronCase(name, world_size, tp=tp, pp=pp, layers=layers, formats=("fully_reshardable",))
    )
    case.update(formats=["fully_reshardable"], steps=1, model=model)
    return case


def _warm(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                while handle.read(1 << 24):
                    pass


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import ucformat

    work = Path(args.work)
    model = {
        "hidden_size": args.hidden, "ffn_hidden_size": args.ffn, "vocab_size": args.vocab,
        "num_attention_heads": args.heads, "num_query_groups": args.groups,
        "seq_length": args.seq,
    }  # fmt: skip
    launches = work / "_launch"
    saved = work / "save"
    if not (saved / "fully_reshardable" / ".metadata").is_file():
        job = _case("save", 2, 2, 1, args.layers, model)
        job.update(kind="save", dir=str(saved), result=str(launches / "save.json"))
        launch_jobs(WORKER, 2, [job], launches, "save", 1800)
    store = work / "ckpt.ucf"
    if not (store / "ucformat.json").is_file():
        ucformat.convert(saved / "fully_reshardable", store)
    _warm(saved)
    _warm(store)
    jobs: dict[int, list[dict[str, Any]]] = {}
    for layout in args.layouts.split(","):
        world, tp, pp = LAYOUTS[layout]
        for attempt in range(args.repeat):
            order = ("stock", "ucformat") if attempt % 2 == 0 else ("ucformat", "stock")
            for how in order:
                name = f"{layout}-{how}-{attempt}"
                job = _case(name, world, tp, pp, args.layers, model)
                path = saved / "fully_reshardable" if how == "stock" else store
                job.update(kind="load", how=how, path=str(path), layout=layout,
                           result=str(launches / f"{name}.json"))  # fmt: skip
                jobs.setdefault(world, []).append(job)
    rows = []
    for world, batch in sorted(jobs.items()):
        launch_jobs(WORKER, world, batch, launches, "load", 3600)
        for job in batch:
            ranks = json.loads(Path(job["result"]).read_text())["ranks"]
            rows.append({"layout": job["layout"], "how": job["how"], "ranks": ranks})
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| layout | W | loader | slowest rank | read per rank (MiB) | read / needed per rank |",
        "|---|---|---|---|---|---|",
    ]
    needed: dict[str, list[int]] = {}
    digests: dict[str, set[tuple[str, ...]]] = {}
    for row in rows:
        if row["how"] == "ucformat":
            needed[row["layout"]] = [r["report"]["bytes_needed"] for r in row["ranks"]]
        digests.setdefault(row["layout"], set()).add(tuple(r["digest"] for r in row["ranks"]))
    for layout in dict.fromkeys(r["layout"] for r in rows):
        for how in ("stock", "ucformat"):
            runs = [r for r in rows if r["layout"] == layout and r["how"] == how]
            if not runs:
                continue
            slowest = statistics.mean(max(rank["seconds"] for rank in r["ranks"]) for r in runs)
            ranks = runs[-1]["ranks"]
            if how == "ucformat":
                read = [rank["report"]["bytes_read"] for rank in ranks]
            else:
                read = [rank["rchar"] for rank in ranks]
            ratio = ", ".join(f"{b / n:.3f}x" for b, n in zip(read, needed[layout], strict=True))
            mib = ", ".join(f"{b / 2**20:.0f}" for b in read)
            label = "`dist_checkpointing.load`" if how == "stock" else "`ucformat.megatron.load`"
            out.append(f"| {layout} | {len(ranks)} | {label} | {slowest:.2f} s | {mib} | {ratio} |")
        same = "yes" if len(digests[layout]) == 1 else "NO"
        out.append(f"| {layout} | | same state | {same} | | |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", required=True)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--layouts", default="tp4,tp2dp2,pp2tp2")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    rows = run(args)
    table = _table(rows)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    Path(args.work, "results.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
