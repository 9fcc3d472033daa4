"""Summarize several live-save benchmark runs against issue #33's targets (docs/benchmarks.md).

``python -m tests.bench.save_runs RESULTS.json [RESULTS.json ...]`` reads the
``results.json`` of each :mod:`tests.bench.save_bench` run (each launch's times are medians of
its repetitions, alternating with the stock save) and prints, per case and target, the ratio of
every run and their median and range, as a markdown table:

* ``durable``: ``save`` / (``save_checkpoint`` + an fsync of what it wrote), target 1.2x;
* ``no fsync``: ``save(fsync=False)`` / ``save_checkpoint``, target 1.5x;
* ``async``: ``save_async`` blocked / the copy floor (one ``clone()`` of the rank's state),
  target 1.2x;
* FSDP2, like for like, target 1.2x: ``ucformat.torch.save(fsync=False)`` / ``dcp.save``, and
  ``ucformat.torch.save`` / (``dcp.save`` + fsync).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

#: (name, numerator, denominator, target) per kind of case.
DEEPSPEED = (
    ("durable", "save", "save_checkpoint_fsync", 1.2),
    ("no fsync", "save_nofsync", "save_checkpoint", 1.5),
    ("async", "save_async_blocked", "copy_floor", 1.2),
)
FSDP = (
    ("no fsync", "ucformat.torch.save nofsync", "dcp.save", 1.2),
    ("durable", "ucformat.torch.save", "dcp.save fsync", 1.2),
)


def ratios(runs: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[list[float], float]]:
    """(case, target) -> (the ratio of each run, the target)."""
    table: dict[tuple[str, str], tuple[list[float], float]] = {}
    for run in runs:
        for kind, targets in (("ds", DEEPSPEED), ("fsdp", FSDP)):
            for case in run.get(kind, []):
                times = case["times"]
                for name, top, bottom, target in targets:
                    if top in times and bottom in times:
                        entry = table.setdefault((case["case"], name), ([], target))
                        entry[0].append(times[top] / times[bottom])
    return table


def main() -> None:
    """Print the summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, nargs="+")
    args = parser.parse_args()
    runs = [json.loads(path.read_text()) for path in args.results]
    print("| case | target | each run | median (min-max) | met |")
    print("|---|---|---|---|---|")
    for (case, name), (values, target) in ratios(runs).items():
        middle = statistics.median(values)
        each = ", ".join(f"{v:.2f}x" for v in values)
        spread = f"{middle:.2f}x ({min(values):.2f}-{max(values):.2f})"
        verdict = "yes" if middle <= target else f"**no** (by {middle / target - 1:.0%})"
        print(f"| {case} | {name} <= {target}x | {each} | {spread} | {verdict} |")


if __name__ == "__main__":
    main()
