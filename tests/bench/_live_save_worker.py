"""torchrun worker: time saving one engine four ways (benchmark, docs/benchmarks.md).

Launched by :mod:`tests.bench.save_bench` (one launch per world size)::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node N tests/bench/_live_save_worker.py --jobs J

``J``: ``{"case": {...}, "dir": "...", "result": "..."}``. After ``case.steps`` training steps,
each timed between barriers, slowest rank reported:

* ``save_checkpoint``: ``engine.save_checkpoint(dir/native)`` (what ``ds_to_universal`` and
  ``ucformat convert`` then read);
* ``save``: ``ucformat.deepspeed.save(engine, dir/live.ucf)``;
* ``copy_floor``: one plain ``clone()`` of the rank's fp32 partitions and optimizer states (the
  least a non-blocking save must do before training may go on);
* ``save_async``: the time ``save_async`` blocks the caller, and the time until the commit
  while one more training step runs meanwhile (``async_total``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for `tests.*`

import torch

from tests.bench._save_worker import SEED, initialize, setup_deepspeed
from tests.bench.cases import TAG, BenchCase, loss_fn, make_batch


def _step(engine: object, case: BenchCase, step: int, rank: int) -> None:
    tokens, targets = make_batch(case, step, rank)
    loss = loss_fn(engine(tokens), targets)  # type: ignore[operator]
    engine.backward(loss)  # type: ignore[attr-defined]
    engine.step()  # type: ignore[attr-defined]


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return float(value.item())


def main() -> int:
    """Train, then time each way of saving."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    job = json.loads(args.jobs.read_text())
    case = BenchCase(**job["case"])
    setup_deepspeed()
    from deepspeed import comm as dist

    import ucformat.deepspeed
    from ucformat.deepspeed.engine import describe_engine

    rank = dist.get_rank()
    engine = initialize(case, SEED)
    for step in range(case.steps):
        _step(engine, case, step, rank)
    out = Path(job["dir"])
    times: dict[str, float] = {}

    def timed(name: str, action: object) -> object:
        dist.barrier()
        started = time.perf_counter()
        result = action()  # type: ignore[operator]
        times[name] = _slowest(time.perf_counter() - started)
        return result

    timed("save_checkpoint", lambda: engine.save_checkpoint(
        str(out / "native"), tag=TAG, client_state={"universal_checkpoint_info": {}}))  # fmt: skip
    live = out / "live.ucf"
    profile_dir = os.environ.get("UCFORMAT_BENCH_PROFILE")  # cProfile the save, per rank
    if profile_dir:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    report = timed("save", lambda: ucformat.deepspeed.save(engine, live, overwrite=True))
    if profile_dir:
        profiler.disable()
        profiler.dump_stats(str(Path(profile_dir) / f"save-rank{rank}.prof"))
    view = describe_engine(engine)

    def copy_partitions() -> int:
        copies = [t.detach().clone() for t in view.fp32]
        for t in view.fp32:
            copies += [v.clone() for v in view.base_optimizer.state[t].values()
                       if isinstance(v, torch.Tensor) and v.dim() == 1]  # fmt: skip
        return sum(c.numel() * c.element_size() for c in copies)

    copied = timed("copy_floor", copy_partitions)
    dist.barrier()
    started = time.perf_counter()
    handle = ucformat.deepspeed.save_async(engine, out / "async.ucf", overwrite=True)
    times["save_async_blocked"] = _slowest(time.perf_counter() - started)
    _step(engine, case, case.steps, rank)  # training goes on while the store is written
    async_report = handle.result()
    times["async_total"] = _slowest(time.perf_counter() - started)
    dist.barrier()
    if rank == 0:
        Path(job["result"]).write_text(json.dumps({
            "case": case.name, "times": times, "partition_bytes_rank0": copied,
            "save_bytes_written_rank0": report.bytes_written,  # type: ignore[attr-defined]
            "save_bytes_received_rank0": report.bytes_received,  # type: ignore[attr-defined]
            "async_host_copy_bytes_rank0": async_report.host_copy_bytes,
        }, indent=1))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
