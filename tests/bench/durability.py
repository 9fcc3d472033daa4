"""Cost of the commit's fsyncs and of the source CRC-32 check, side by side with both off.

Run from the repository root (not part of the test suite)::

    python -m tests.bench.durability --grid $UCFORMAT_GRID_CACHE [--repeat 5] [--out DIR]

Converts real DeepSpeed checkpoints of the fixture grid (the ``wide`` model: 1.6M parameters,
ZeRO-1 fp32 and ZeRO-3 bf16 at world size 2) with ``ucformat.convert`` in-process, in four
variants: fsync on/off x source CRC check on/off, each with the default 16 MiB shards and with
256 KiB shards (many more files to fsync). Runs are interleaved in a rotating order; before each
one: ``sync`` (no dirty pages of the previous run) and a read of the whole source (warm page
cache), the output folder removed. Prints a markdown table of median wall times (min-max), and
the raw ``zlib.crc32`` throughput on the same bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

import ucformat

CASES = ("z1-fp32-dsadam-wide-ws2", "z3-bf16-tadam-wide-ws2")
VARIANTS = (  # (label, fsync, check_source)
    ("fsync + CRC (default)", True, True),
    ("fsync, no CRC", True, False),
    ("CRC, no fsync", False, True),
    ("neither", False, False),
)
SHARDS = (("16 MiB shards", 16 << 20), ("256 KiB shards", 256 << 10))


def warm(folder: Path) -> int:
    """Read every file of ``folder`` (page cache); return the bytes."""
    total = 0
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            total += len(path.read_bytes())
    return total


def crc_throughput(folder: Path) -> float:
    """GB/s of ``zlib.crc32`` over the bytes of ``folder`` (in memory)."""
    blobs = [p.read_bytes() for p in sorted(folder.rglob("*.pt"))]
    started = time.perf_counter()
    for blob in blobs:
        zlib.crc32(blob)
    return sum(map(len, blobs)) / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=Path, default=os.environ.get("UCFORMAT_GRID_CACHE"))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="scratch folder for the stores")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="ucf-durability-"))
    rows = []
    for case in CASES:
        source = args.grid / case / "ckpt"
        nbytes = warm(source)
        times: dict[tuple[str, str], list[float]] = {}
        files: dict[str, int] = {}
        runs = [(s, v) for s in SHARDS for v in VARIANTS]
        for repeat in range(args.repeat):
            for index in range(len(runs)):
                (shard_label, shard_bytes), (label, fsync, crc) = runs[(index + repeat) % len(runs)]
                store = out / "store"
                shutil.rmtree(store, ignore_errors=True)
                subprocess.run(["sync"], check=True)
                warm(source)
                started = time.perf_counter()
                ucformat.convert(
                    source, store, shard_bytes=shard_bytes, fsync=fsync, check_source=crc
                )
                times.setdefault((shard_label, label), []).append(time.perf_counter() - started)
                files[shard_label] = sum(1 for p in store.rglob("*") if p.is_file())
        for (shard_label, label), values in times.items():
            rows.append((case, nbytes, shard_label, files[shard_label], label, values))
        print(f"{case}: zlib.crc32 {crc_throughput(source):.2f} GB/s on its shard files")
    shutil.rmtree(out, ignore_errors=True)
    print("\n| checkpoint | shards | files | variant | median s | min-max s |")
    print("|---|---|---:|---|---:|---|")
    for case, nbytes, shard_label, count, label, values in rows:
        print(
            f"| {case} ({nbytes / 1e6:.0f} MB) | {shard_label} | {count} | {label} | "
            f"{statistics.median(values):.3f} | {min(values):.3f}-{max(values):.3f} |"
        )


if __name__ == "__main__":
    main()
