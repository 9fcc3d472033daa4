"""torchrun worker: ``ucformat.torch.save`` vs stock ``dcp.save`` of one FSDP2 state (benchmark).

Launched by :mod:`tests.bench.save_bench` (``--fsdp``)::

    torchrun --nproc_per_node N tests/bench/_fsdp_save_worker.py --jobs J

``J``: ``{"size": "100m", "dir": "...", "result": "...", "repeat": 3}``. The benchmark decoder
(:mod:`tests.bench.cases`, fp32) under ``fully_shard`` (each block, then the whole model),
AdamW, one training step; then, ``repeat`` times in alternating order, each timed between
barriers (slowest rank): ``ucformat.torch.save(model,
optimizer, DIR)`` and ``dcp.save({"model": get_model_state_dict(m), "optim":
get_optimizer_state_dict(m, opt)}, checkpoint_id=DIR)`` (the state-dict calls included: both
start from the live model), each destination as the job's ``protocol`` says
(:mod:`tests.bench.destinations`); and the like-for-like pairs: ``ucformat.torch.save(...,
fsync=False)`` (ucformat fsyncs its store by default, ``dcp.save`` does not) and ``dcp.save``
followed by an fsync of what it wrote (:mod:`tests.bench.durable`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for `tests.*`

import torch

from tests.bench.cases import SIZES, BenchCase, Decoder, loss_fn, make_batch
from tests.bench.destinations import Destinations
from tests.bench.durable import fsync_share


def main() -> int:
    """Train one step, then time both saves."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ucformat.torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=Path, required=True)
    job = json.loads(parser.parse_args().jobs.read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    case = BenchCase(job["size"], 3, world_size=world)
    torch.manual_seed(0)
    model = Decoder(SIZES[job["size"]])
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    tokens, targets = make_batch(case, 0, rank)
    loss_fn(model(tokens), targets).backward()
    optimizer.step()
    out = Path(job["dir"])
    ucf, native = out / "fsdp.ucf", out / "fsdp.dcp"

    def ucformat_save(target: Path, fsync: bool = True) -> None:
        ucformat.torch.save(model, optimizer, target, overwrite=True, fsync=fsync)

    def dcp_save(target: Path) -> None:
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer),
        }
        dcp.save(state, checkpoint_id=str(target))

    def dcp_save_fsync(target: Path) -> None:
        dcp_save(target)
        dist.barrier()
        fsync_share(target, rank, world)

    runs: dict[str, list[float]] = {}
    pair: list[tuple[str, Any, Path]] = [
        ("ucformat.torch.save", ucformat_save, ucf),
        ("dcp.save", dcp_save, native),
        ("ucformat.torch.save nofsync", lambda target: ucformat_save(target, fsync=False), ucf),
        ("dcp.save fsync", dcp_save_fsync, native),
    ]
    places = Destinations(job.get("protocol", "fresh"), rank, job.get("not_before", 0.0))
    for index in range(int(job.get("repeat", 3))):
        for name, action, base in pair[:: -1 if index % 2 else 1]:
            target = places.next(base)  # fresh or emptied (the protocol)
            dist.barrier()
            started = time.perf_counter()
            action(target)
            seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            runs.setdefault(name, []).append(float(seconds.item()))
    dist.barrier()
    if rank == 0:
        sizes = {
            name: sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            for name, _, folder in pair
        }
        Path(job["result"]).write_text(json.dumps({
            "case": f"fsdp2-fp32-{job['size']}-ws{world}",
            "params": sum(p.numel() for p in model.parameters()),
            "times": {name: statistics.median(values) for name, values in runs.items()},
            "runs": runs, "bytes": sizes,
        }, indent=1))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
