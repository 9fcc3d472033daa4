"""``ucformat convert`` of a DCP folder against stock ``dcp_to_torch_save`` (a benchmark).

1. ``--save``: an FSDP2 job (``torchrun``, gloo, ``--ranks`` processes) trains one step of an MLP of
   ``--layers`` x ``Linear(--width, --width)`` (24 x 2048: 100.7M params) with torch Adam and
   saves ``{"model", "optimizer"}`` (flattened optimizer dict) with stock ``dcp.save``: fp32
   weights, ``exp_avg``, ``exp_avg_sq`` (1.2 GB).
2. Each tool runs in a fresh process, alternating, ``--repeats`` times, after one warm-up read of
   the folder (page cache warm for both): wall time and the peak RSS of the process
   (:mod:`tests.bench.measure`):

   * ``ucformat convert DIR out.ucf``: the store (every state, sharded, checksummed);
   * ``dcp_to_torch_save(DIR, out.pt)``: PyTorch's own one-file conversion (``torch.load``\\ s
     every item into memory, then ``torch.save``\\ s the whole dict).

Usage::

    python -m tests.bench.dcp_convert --work /tmp/ucf_dcp_bench [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from tests.bench.measure import measure, tree_size
from tests.launch import run_in_group, torchrun_command

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20


def _save(folder: Path, layers: int, width: int) -> None:
    """The torchrun worker: one FSDP2 training step, then stock ``dcp.save``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_saver import save
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).square().mean().backward()
    optimizer.step()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=flat),
    }
    save(state, checkpoint_id=folder)
    dist.destroy_process_group()


def _make(folder: Path, ranks: int, layers: int, width: int) -> None:
    if (folder / ".metadata").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)
    program = ["-m", "tests.bench.dcp_convert", "--save", str(folder), "--layers", str(layers),
               "--width", str(width)]  # fmt: skip
    done = run_in_group(torchrun_command(ranks, program), timeout_s=3600)
    if done.returncode != 0:
        raise RuntimeError(f"dcp_convert save failed ({done.returncode})")


def _warm(folder: Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as handle:
            while handle.read(64 * MIB):
                pass


def _commands(folder: Path, out: Path) -> dict[str, list[str]]:
    stock = (
        "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
        "dcp_to_torch_save(sys.argv[1], sys.argv[2])"
    )
    ucformat = str(Path(sys.executable).with_name("ucformat"))
    return {
        "ucformat convert": [ucformat, "convert", str(folder), str(out / "out.ucf"), "-q"],
        "dcp_to_torch_save": [sys.executable, "-c", stock, str(folder), str(out / "out.pt")],
    }


def run(work: Path, ranks: int, layers: int, width: int, repeats: int) -> dict[str, Any]:
    """Make the checkpoint (once) and measure both tools; return the results."""
    folder = work / f"dcp-{layers}x{width}-ws{ranks}"
    _make(folder, ranks, layers, width)
    out = work / "out"
    results: dict[str, list[dict[str, Any]]] = {}
    for _ in range(repeats):
        for name, cmd in _commands(folder, out).items():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            _warm(folder)
            stats = measure(cmd, watch=out)
            if stats.returncode != 0:
                raise RuntimeError(f"{name} failed with exit status {stats.returncode}")
            results.setdefault(name, []).append({**stats.to_dict(), "out_bytes": tree_size(out)})
    params = layers * width * (width + 1)
    return {
        "params": params,
        "checkpoint_bytes": tree_size(folder),
        "ranks": ranks,
        "runs": results,
        "median": {
            name: {
                "wall_s": statistics.median(r["wall_s"] for r in runs),
                "max_rss_mib": statistics.median(r["max_rss"] for r in runs) / MIB,
            }
            for name, runs in results.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (prints a Markdown table and the JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ucf_dcp_bench"))
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.save is not None:
        _save(args.save, args.layers, args.width)
        return 0
    result = run(args.work, args.ranks, args.layers, args.width, args.repeats)
    print(f"{result['params'] / 1e6:.1f}M params, DCP folder {result['checkpoint_bytes'] / MIB:.0f}"
          f" MiB from {result['ranks']} ranks")  # fmt: skip
    print("| tool | wall (median) | peak RSS (median) |\n|---|---|---|")
    for name, median in result["median"].items():
        print(f"| {name} | {median['wall_s']:.2f} s | {median['max_rss_mib']:.0f} MiB |")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
