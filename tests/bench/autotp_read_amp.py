"""Bytes per rank of a DeepSpeed AutoTP load of a store with box chunks (measured).

Trains the AutoTP Llama of tests/fixtures/autotp_cases.py widened to hidden 512 and MLP 1024
(``UCFORMAT_AUTOTP_WIDE=1``: q and o 1 MiB, gate/up/down 2 MiB fp32; k and v 0.5 MiB) at
tp 2 x dp 1, ZeRO-1, converts it with the default chunking, and loads it with
``ucformat.deepspeed.load`` at tp 2 x dp 1 and tp 1 x dp 2, each compared with DeepSpeed's own
universal load (tests/fixtures/_autotp_load.py). Prints every rank's bytes read and needed.

    python -m tests.bench.autotp_read_amp --work /tmp/ucf_autotp_bench
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ucf_autotp_bench"))
    args = parser.parse_args(argv)
    os.environ["UCFORMAT_AUTOTP_WIDE"] = "1"  # read by llama_config() here and in the workers
    from tests.fixtures.autotp_cases import (
        AutoTPCase,
        AutoTPLoad,
        generate_autotp,
        run_autotp_loads,
    )

    case = AutoTPCase(2, 1, 1, "fp32")
    fixtures = generate_autotp((case,), args.work / "cache")
    loads = (AutoTPLoad(case.name, 2, 1, 1), AutoTPLoad(case.name, 1, 2, 1))
    results = run_autotp_loads(loads, fixtures, args.work / "loads")
    print("| load | rank | read | needed | read / needed | failures |")
    print("|---|---|---|---|---|---|")
    for name, result in results.items():
        for rank in result["ranks"]:
            read, needed = rank["bytes_read"], rank["bytes_needed"]
            print(f"| {name} | {rank['rank']} | {read:,} | {needed:,} | {read / needed:.3f} "
                  f"| {len(rank['failures'])} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
