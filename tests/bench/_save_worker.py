"""torchrun worker: train a benchmark decoder with DeepSpeed ZeRO on CPU and save a checkpoint.

Launched by :mod:`tests.bench.checkpoints` (one launch per case)::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node N tests/bench/_save_worker.py --jobs J

``J`` is a JSON file ``{"case": {...}, "dir": "...", "fingerprint": "..."}``. The worker trains
``case.steps`` optimizer steps, writes ``<dir>/ckpt/`` with ``engine.save_checkpoint`` (client
state ``{"universal_checkpoint_info": {}}``, which DeepSpeed's ``ds_to_universal`` needs for
ZeRO-1/2), then ``<dir>/case.json`` (the fingerprint, written last: the cache marker).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for `tests.*`

from tests.bench.cases import TAG, BenchCase, build_model, ds_config, loss_fn, make_batch

SEED = 1234


def setup_deepspeed() -> None:
    """gloo on CPU, quiet logs."""
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(minutes=20), verbose=False)


def initialize(case: BenchCase, seed: int, *, load_universal: bool = False) -> object:
    """The DeepSpeed engine of ``case`` (model built with ``seed``)."""
    import deepspeed

    model, groups = build_model(case, seed)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=groups,
        config=ds_config(case, load_universal=load_universal),
    )  # fmt: skip
    return engine


def main() -> int:
    """Train, save, mark complete."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    job = json.loads(args.jobs.read_text())
    case = BenchCase(**job["case"])
    setup_deepspeed()
    from deepspeed import comm as dist

    rank = dist.get_rank()
    engine = initialize(case, SEED)
    for step in range(case.steps):
        tokens, targets = make_batch(case, step, rank)
        loss = loss_fn(engine(tokens), targets)
        engine.backward(loss)
        engine.step()
    out = Path(job["dir"])
    engine.save_checkpoint(
        str(out / "ckpt"), tag=TAG, client_state={"universal_checkpoint_info": {}}
    )
    dist.barrier()
    if rank == 0:
        (out / "case.json").write_text(
            json.dumps({"name": case.name, "fingerprint": job["fingerprint"]}, indent=1)
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
