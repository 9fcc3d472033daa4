"""Bytes per rank of the DTensor TP / FSDP2 + TP loads of tests/integration/test_dtensor_tp.py.

Runs the test's jobs (tests/fixtures/run_tp.py: cached sources, two torchrun launches) and
prints, per load, every rank's bytes read and needed (all arrays, and the matrices of at least
1 MiB): the measured table of docs/benchmarks.md, "Tensor-parallel loads".

    python -m tests.bench.tp_measured --work /tmp/ucf_tp_bench
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path

from tests.fixtures.run_tp import run_tp


def _cell(values: Sequence[int]) -> str:
    distinct = sorted(set(values))
    return " / ".join(f"{v:,}" for v in distinct)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ucf_tp_bench"))
    args = parser.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    results = run_tp(args.work, verbose=False)
    print("| load | read | needed | read / needed | >= 1 MiB: read / needed (worst rank) |")
    print("|---|---|---|---|---|")
    for name, result in sorted(results.items()):
        if "bytes_read" not in result:
            continue
        read, needed = result["bytes_read"], result["bytes_needed"]
        worst = max(
            r / n for r, n in zip(result["bytes_read"], result["bytes_needed"], strict=True)
        )
        large = max(
            r / n for r, n in zip(result["large_read"], result["large_needed"], strict=True)
        )
        print(f"| {name} | {_cell(read)} | {_cell(needed)} | {worst:.3f} | {large:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
