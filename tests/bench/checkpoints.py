"""Make (or reuse) the benchmark's DeepSpeed checkpoints under a cache folder.

``ensure_checkpoint(case, cache)`` returns ``cache/<case>/ckpt/<tag>``; a folder whose
``case.json`` fingerprint matches is reused, anything else is rebuilt with one torchrun launch
of :mod:`tests.bench._save_worker` (``DS_ACCELERATOR=cpu``, gloo).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from tests.bench.cases import TAG, BenchCase, fingerprint
from tests.fixtures.make_fixtures import FixtureGenerationError
from tests.launch import log_excerpt, run_in_group, torchrun_command

SAVE_WORKER = Path(__file__).resolve().parent / "_save_worker.py"
SAVE_TIMEOUT_S = 900.0


def case_dir(case: BenchCase, cache: Path) -> Path:
    """Where ``case`` lives in the cache."""
    return cache / case.name


def is_cached(case: BenchCase, cache: Path) -> bool:
    """Whether a complete checkpoint of exactly this case is in the cache."""
    record = case_dir(case, cache) / "case.json"
    try:
        return bool(json.loads(record.read_text())["fingerprint"] == fingerprint(case))
    except (OSError, ValueError, KeyError):
        return False


def ensure_checkpoint(case: BenchCase, cache: Path, *, verbose: bool = True) -> Path:
    """The tag folder of ``case``'s checkpoint, saving it first if needed."""
    where = case_dir(case, cache)
    tag_dir = where / "ckpt" / TAG
    if is_cached(case, cache):
        return tag_dir
    if where.exists():
        shutil.rmtree(where)
    where.mkdir(parents=True)
    job = where / "job.json"
    job.write_text(
        json.dumps({"case": case.__dict__, "dir": str(where), "fingerprint": fingerprint(case)})
    )
    log = where / "save.log"
    started = time.monotonic()
    command = torchrun_command(case.world_size, [str(SAVE_WORKER), "--jobs", str(job)])
    status = run_in_group(command, timeout_s=SAVE_TIMEOUT_S, log_path=log).returncode
    if status != 0 or not is_cached(case, cache):
        raise FixtureGenerationError(
            f"saving {case.name} failed ({status}); log: {log}\n{log_excerpt(log)}"
        )
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        (where / "ckpt" / name).unlink(missing_ok=True)
    if verbose:
        print(f"[bench] saved {case.name} in {time.monotonic() - started:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    return tag_dir
