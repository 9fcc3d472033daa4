"""torchrun worker of :mod:`tests.bench.megatron_load`: save a larger Megatron-Core GPT, or load
it at a layout with Megatron's own ``dist_checkpointing.load`` or ``ucformat.megatron.load``.

The model is the fixture worker's (:mod:`tests.fixtures._megatron_worker`: GQA, SwiGLU, RMSNorm,
RoPE, local layer spec) at the sizes of the job's ``model`` (its ``MODEL`` entries replaced).
Jobs: ``save`` (train one step, save ``fully_reshardable``); ``load`` (``how``: ``stock`` or
``ucformat``): per rank the wall seconds of the load, the bytes the process read through
syscalls (``rchar`` of ``/proc/self/io``: page-cache hits included) and, for ucformat, its
report; and a digest of what the rank holds afterwards (both loaders must agree).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.fixtures import _megatron_worker as fixture  # noqa: E402
from tests.fixtures._megatron_worker import serve  # noqa: E402


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def _digest(gpts: list[Any], optimizer: Any) -> str:
    """Of every tensor the rank holds: the model and each inner optimizer's torch state."""
    digest = hashlib.sha256()
    for gpt in gpts:
        for key, value in sorted(gpt.state_dict().items()):
            if isinstance(value, torch.Tensor):
                digest.update(key.encode())
                digest.update(value.detach().float().contiguous().numpy().tobytes())
    for inner in optimizer.chained_optimizers:
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                digest.update(param.detach().contiguous().numpy().tobytes())
                for key, value in sorted(inner.optimizer.state[param].items()):
                    digest.update(key.encode())
                    digest.update(value.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _save(job: dict[str, Any], rank: int) -> dict[str, Any]:
    ddps, gpts, optimizer, _ = fixture._build(job)
    scheduler = fixture._scheduler(optimizer, job)
    fixture._train(ddps, optimizer, scheduler, job)
    fixture._save(job, gpts, optimizer, scheduler, "fully_reshardable", rank)
    return {}


def _load(job: dict[str, Any], rank: int) -> dict[str, Any]:
    from megatron.core import dist_checkpointing, parallel_state

    import ucformat.megatron  # imported at the job's start, as the stock loader's modules are

    ddps, gpts, optimizer, _ = fixture._build(job)
    torch.distributed.barrier()
    before, started = _rchar(), time.perf_counter()
    report: dict[str, Any] = {}
    profile = os.environ.get("UCF_PROFILE")  # a folder: cProfile each rank's load into it
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    if job["how"] == "stock":
        for inner in optimizer.chained_optimizers:
            inner._init_optimizer_states_with_dummy_values()
        metadata = dist_checkpointing.load_content_metadata(job["path"]) or {}
        metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
        request: dict[str, Any] = {"model": gpts[0].sharded_state_dict(metadata=dict(metadata))}
        request["optimizer"] = optimizer.sharded_state_dict(
            request, is_loading=True, metadata=dict(metadata)
        )
        state = dist_checkpointing.load(request, job["path"])
        gpts[0].load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    else:
        result = ucformat.megatron.load(ddps[0], optimizer, job["path"])
        report = {"bytes_read": result.bytes_read, "bytes_needed": result.bytes_needed}
    seconds = time.perf_counter() - started
    read = _rchar() - before
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(f"{profile}/{job['name']}-r{rank}.prof")
    return {"seconds": seconds, "rchar": read, "report": report, "digest": _digest(gpts, optimizer)}


def _run(job: dict[str, Any], rank: int) -> dict[str, Any]:
    """The job at the job's model sizes; every rank's result, gathered."""
    fixture.MODEL.update(job["model"])
    result = _save(job, rank) if job["kind"] == "save" else _load(job, rank)
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, result)
    return {"ranks": gathered}


def main(argv: list[str] | None = None) -> int:
    return serve(_run, __doc__ or "", argv)


if __name__ == "__main__":
    sys.exit(main())
