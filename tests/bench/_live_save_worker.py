"""torchrun worker: time saving one engine four ways (benchmark, docs/benchmarks.md).

Launched by :mod:`tests.bench.save_bench` (one launch per world size)::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node N tests/bench/_live_save_worker.py --jobs J

``J``: ``{"case": {...}, "dir": "...", "result": "...", "protocol": "fresh", "not_before": T}``
(where each save goes: :mod:`tests.bench.destinations`). After ``case.steps`` training steps,
each timed between barriers, slowest rank reported:

* ``save_checkpoint``: ``engine.save_checkpoint(dir/native)`` (what ``ds_to_universal`` and
  ``ucformat convert`` then read);
* ``save``: ``ucformat.deepspeed.save(engine, dir/live.ucf)`` (it fsyncs the store);
* ``save_nofsync``: the same with ``fsync=False`` (writeback left to the OS, as
  ``save_checkpoint`` leaves it), and ``save_checkpoint_fsync``: ``save_checkpoint`` followed
  by an fsync of every file and directory it wrote (:mod:`tests.bench.durable`): the two
  like-for-like pairs;
* ``copy_floor``: one plain ``clone()`` of the rank's fp32 partitions and optimizer states (the
  least a non-blocking save must do before training may go on);
* ``save_async``: the time ``save_async`` blocks the caller, and the time until the commit
  while one more training step runs meanwhile (``async_total``);
* with ``"s3": "s3://bucket/prefix"`` in ``J`` (the local S3 server), then ``save`` and
  ``save_async`` (blocked and total, one training step meanwhile) to fresh prefixes under it.

With ``"repeat": N``, each pair runs N times in alternating order; ``times`` are medians. The
first ucformat save of the launch plans the store; every later one takes the engine's kept plan
(``plan_kept`` in the result, per timed save).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for `tests.*`

import torch

from tests.bench._save_worker import SEED, initialize, setup_deepspeed
from tests.bench.cases import TAG, BenchCase, loss_fn, make_batch
from tests.bench.destinations import Destinations
from tests.bench.durable import fsync_share


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
    repeat = int(job.get("repeat", 1))
    runs: dict[str, list[float]] = {}

    places = Destinations(job.get("protocol", "fresh"), rank, job.get("not_before", 0.0))

    def timed(name: str, action: Any, base: Path | None = None) -> object:
        target = None if base is None else places.next(base)  # fresh or emptied (protocol)
        dist.barrier()
        started = time.perf_counter()
        result = action() if target is None else action(target)
        runs.setdefault(name, []).append(_slowest(time.perf_counter() - started))
        return result

    native, live = out / "native", out / "live.ucf"
    profile_dir = os.environ.get("UCFORMAT_BENCH_PROFILE")  # cProfile the first save, per rank

    def save(target: Path) -> object:
        if not (profile_dir and "save" not in runs):
            return ucformat.deepspeed.save(engine, target, overwrite=True)
        import cProfile

        profiler = cProfile.Profile()
        report = profiler.runcall(ucformat.deepspeed.save, engine, target, overwrite=True)
        profiler.dump_stats(str(Path(profile_dir) / f"save-rank{rank}.prof"))
        return report

    view = describe_engine(engine)

    def copy_partitions() -> int:
        copies = [t.detach().clone() for t in view.fp32]
        for t in view.fp32:
            copies += [v.clone() for v in view.base_optimizer.state[t].values()
                       if isinstance(v, torch.Tensor) and v.dim() == 1]  # fmt: skip
        return sum(c.numel() * c.element_size() for c in copies)

    def save_async() -> object:
        target = places.next(out / "async.ucf")
        dist.barrier()
        started = time.perf_counter()
        handle = ucformat.deepspeed.save_async(engine, target, overwrite=True)
        runs.setdefault("save_async_blocked", []).append(_slowest(time.perf_counter() - started))
        _step(engine, case, case.steps, rank)  # training goes on while the store is written
        result = handle.result()
        runs.setdefault("async_total", []).append(_slowest(time.perf_counter() - started))
        return result

    copied, report, async_report = 0, None, None
    kept: list[bool] = []  # per timed save: whether it took the engine's kept plan
    for index in range(repeat):  # each pair in alternating order
        order = -1 if index % 2 else 1

        def save_checkpoint(target: Path) -> None:
            engine.save_checkpoint(
                str(target), tag=TAG, client_state={"universal_checkpoint_info": {}}
            )

        def save_checkpoint_fsync(target: Path) -> None:
            save_checkpoint(target)
            dist.barrier()  # every rank's files are written
            fsync_share(target, rank, dist.get_world_size())

        pair: list[tuple[str, Any, Path]] = [
            ("save_checkpoint", save_checkpoint, native),
            ("save", save, live),
            ("save_nofsync", lambda target: ucformat.deepspeed.save(
                engine, target, overwrite=True, fsync=False), live),
            ("save_checkpoint_fsync", save_checkpoint_fsync, native),
        ]  # fmt: skip
        for name, action, base in pair[::order]:
            result = timed(name, action, base)
            if name in ("save", "save_nofsync"):
                kept.append(bool(result.plan_kept))  # type: ignore[attr-defined]
            if name == "save":
                report = result
        for name in ("copy_floor", "save_async")[::order]:
            if name == "copy_floor":
                copied = int(timed(name, copy_partitions))  # type: ignore[call-overload]
            else:
                async_report = save_async()
    remote = job.get("s3")  # an s3:// prefix on the local S3 server: save vs save_async there
    for index in range(repeat if remote else 0):

        def save_s3(index: int = index) -> object:
            return ucformat.deepspeed.save(engine, f"{remote}/sync-{index}")

        def save_async_s3(index: int = index) -> None:
            dist.barrier()
            started = time.perf_counter()
            handle = ucformat.deepspeed.save_async(engine, f"{remote}/async-{index}")
            runs.setdefault("s3_save_async_blocked", []).append(
                _slowest(time.perf_counter() - started)
            )
            _step(engine, case, case.steps, rank)
            handle.result()
            runs.setdefault("s3_async_total", []).append(_slowest(time.perf_counter() - started))

        for name in ("s3_save", "s3_save_async")[:: -1 if index % 2 else 1]:
            if name == "s3_save":
                timed(name, save_s3)
            else:
                save_async_s3()
    times = {name: statistics.median(values) for name, values in runs.items()}
    dist.barrier()
    if rank == 0:
        Path(job["result"]).write_text(json.dumps({
            "case": case.name, "times": times, "runs": runs, "partition_bytes_rank0": copied,
            "save_bytes_written_rank0": report.bytes_written,  # type: ignore[attr-defined]
            "save_bytes_received_rank0": report.bytes_received,  # type: ignore[attr-defined]
            "async_host_copy_bytes_rank0": async_report.host_copy_bytes,  # type: ignore[attr-defined]
            "plan_kept": kept,
        }, indent=1))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
