"""torchrun worker: time DeepSpeed's universal load against ``ucformat.deepspeed.load``.

Launched by :mod:`tests.bench.run_bench` (one launch per world size and checkpoint)::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node W tests/bench/_load_worker.py --jobs J

``J`` is a JSON file ``{"case": {...}, "ds_dir": DIR, "store": STORE, "order": [...],
"result": PATH}``: ``DIR`` holds ``latest_universal`` and the folder ``ds_to_universal``
wrote, ``STORE`` the ucformat store of the same checkpoint. Every rank builds the model with a
fresh seed and one DeepSpeed engine (``checkpoint.load_universal`` on, which only DeepSpeed's
loader reads), then runs the loaders in ``order`` (e.g. ``ds, ucf, ucf, ds``), each into the same
engine after its fp32 partitions and Adam states were zeroed. Per load and rank it records the
rank's own wall time (from a barrier to the end of its load), the bytes the process read
(``/proc/self/io`` ``rchar``), the bytes of the files ``torch.load`` opened, ucformat's
``bytes_read``/``bytes_needed``, and a SHA-256 of the rank's fp32 partitions and Adam states
afterwards (both loaders must give the same). Rank 0 writes everything to ``result``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for `tests.*`

from tests.bench._save_worker import initialize, setup_deepspeed
from tests.bench.cases import BenchCase

FRESH_SEED = 4321
_TORCH_LOAD_BYTES = [0]


def _count_torch_load() -> None:
    """Wrap ``torch.load`` to add up the sizes of the files it opens."""
    original = torch.load

    def counting(f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, str | os.PathLike):
            _TORCH_LOAD_BYTES[0] += os.path.getsize(f)
        return original(f, *args, **kwargs)

    torch.load = counting  # type: ignore[assignment]


def _rchar() -> int:
    with open("/proc/self/io") as handle:
        for line in handle:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _state_tensors(engine: Any) -> list[torch.Tensor]:
    from ucformat.deepspeed.engine import describe_engine

    view = describe_engine(engine)
    out = []
    for fp32 in view.fp32:
        out.append(fp32)
        state = view.base_optimizer.state.get(fp32, {})
        out += [state[k] for k in ("exp_avg", "exp_avg_sq") if k in state]
    return out


def _reset(engine: Any) -> None:
    with torch.no_grad():
        for tensor in _state_tensors(engine):
            tensor.zero_()


def _digest(engine: Any) -> str:
    digest = hashlib.sha256()
    for tensor in _state_tensors(engine):
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def _load(kind: str, engine: Any, job: dict[str, Any]) -> dict[str, Any]:
    if kind == "ds":
        engine.load_checkpoint(job["ds_dir"])
        return {}
    import ucformat.deepspeed

    profile = os.environ.get("UCF_BENCH_PROFILE")  # a folder: pyinstrument each ucf load
    if profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.002)
        profiler.start()
    report = ucformat.deepspeed.load(engine, job["store"])
    if profile:
        profiler.stop()
        rank = int(os.environ.get("RANK", "0"))
        Path(profile, f"ucf-load-rank{rank}-{time.time():.0f}.txt").write_text(
            profiler.output_text(show_all=False)
        )
    return {"store_bytes_read": report.bytes_read, "bytes_needed": report.bytes_needed}


def main() -> int:
    """Run the loads of ``--jobs``; rank 0 writes the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    job = json.loads(args.jobs.read_text())
    setup_deepspeed()
    from deepspeed import comm as dist

    import ucformat.deepspeed  # noqa: F401  (imported before any timing)

    _count_torch_load()
    case = BenchCase(**job["case"])
    engine = initialize(case, FRESH_SEED, load_universal=True)
    rows = []
    for kind in job["order"]:
        _reset(engine)
        dist.barrier()
        io0, tl0 = _rchar(), _TORCH_LOAD_BYTES[0]
        started = time.perf_counter()
        extra = _load(kind, engine, job)
        seconds = time.perf_counter() - started
        row = {"loader": kind, "seconds": seconds, "rchar": _rchar() - io0,
               "torch_load_bytes": _TORCH_LOAD_BYTES[0] - tl0, **extra}  # fmt: skip
        dist.barrier()
        row["job_seconds"] = time.perf_counter() - started
        row["digest"] = _digest(engine)
        rows.append(row)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() == 0:
        Path(job["result"]).write_text(json.dumps({"ranks": everyone}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
