"""Benchmark: FSDP2 resume at a new world size, ucformat store vs stock ``dcp.load``.

Run from the repository root (not part of the test suite)::

    python -m tests.bench.fsdp_resume --work /tmp/ucf_fsdpbench [--hidden 2048] [--layers 6]
        [--save-world-size 2] [--load-world-size 3] [--repeat 2] [--markdown OUT.md]

1. **save** (one torchrun launch at ``--save-world-size``): an MLP of ``--layers`` square
   Linear layers (fp32) under ``fully_shard`` trains one AdamW step; the same state is written
   twice: ``ucformat.torch.save`` (a store) and stock ``dcp.save({"model":
   get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)})`` (a DCP folder).
2. **resume** (fresh torchrun launches at ``--load-world-size``, alternating ucf, dcp, dcp, ucf,
   ...): a fresh model and optimizer; ``ucformat.torch.load`` from the store, or DCP's own
   recipe (``get_state_dict`` as the skeleton, ``dcp.load``, ``set_state_dict``). Per rank: wall
   seconds of the call, bytes read (the process's ``rchar`` delta from ``/proc/self/io``: every
   byte read through a syscall, page-cache hits included), and a digest of the gathered state
   (both loaders must give the same).

Page cache: both sources are read once before the first resume, so every run starts warm.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def _model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden) for _ in range(layers)))


def _sharded(hidden: int, layers: int, seed: int) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = _model(hidden, layers)
    if seed:
        for param in model.parameters():
            torch.nn.init.normal_(param)
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _digest(model: torch.nn.Module, optimizer: Any) -> str:
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.full_tensor().detach().numpy().tobytes())
        for key in ("exp_avg", "exp_avg_sq"):
            digest.update(optimizer.state[param][key].full_tensor().numpy().tobytes())
        digest.update(str(float(optimizer.state[param]["step"])).encode())
    return digest.hexdigest()[:16]


def worker(args: argparse.Namespace) -> None:
    """One torchrun rank: the save phase, or one resume."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )

    import ucformat.torch

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work = Path(args.work)
    if args.phase == "save":
        model, optimizer = _sharded(args.hidden, args.layers, 0)
        x = torch.randn(8, args.hidden)
        model(x).square().mean().backward()
        optimizer.step()
        ucformat.torch.save(model, optimizer, work / "ckpt.ucf", overwrite=True)
        dcp.save(
            {
                "model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, optimizer),
            },
            checkpoint_id=str(work / "ckpt.dcp"),
        )
        digest = _digest(model, optimizer)
        if rank == 0:
            (work / "saved.json").write_text(json.dumps({"digest": digest}))
    else:
        model, optimizer = _sharded(args.hidden, args.layers, 1 + rank)
        dist.barrier()
        before, started = _rchar(), time.perf_counter()
        if args.loader == "ucf":
            ucformat.torch.load(model, optimizer, work / "ckpt.ucf")
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=str(work / "ckpt.dcp"))
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])  # fmt: skip
        seconds, read = time.perf_counter() - started, _rchar() - before
        dist.barrier()
        job = time.perf_counter() - started
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, (seconds, read))
        digest = _digest(model, optimizer)
        if rank == 0:
            out = {
                "loader": args.loader,
                "seconds": [r[0] for r in per_rank],
                "bytes_read": [r[1] for r in per_rank],
                "job_seconds": job,
                "digest": digest,
            }
            with (work / "runs.jsonl").open("a") as f:
                f.write(json.dumps(out) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _launch(world: int, argv: list[str]) -> None:

    from tests.launch import run_in_group, torchrun_command

    cmd = torchrun_command(world, [str(Path(__file__).resolve()), "--worker", *argv])
    done = run_in_group(cmd, timeout_s=3600, capture=True)
    if done.returncode != 0:
        raise RuntimeError(f"fsdp_resume worker failed ({done.returncode}):\n{done.stdout[-3000:]}")


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    """Run both phases and print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--save-world-size", type=int, default=2)
    parser.add_argument("--load-world-size", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--markdown")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="save", help=argparse.SUPPRESS)
    parser.add_argument("--loader", default="ucf", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "runs.jsonl").unlink(missing_ok=True)
    common = ["--work", str(work), "--hidden", str(args.hidden), "--layers", str(args.layers)]
    _launch(args.save_world_size, [*common, "--phase", "save"])
    for folder in ("ckpt.ucf", "ckpt.dcp"):  # warm page cache for both
        for path in (work / folder).rglob("*"):
            if path.is_file():
                path.read_bytes()
    order = ["ucf", "dcp", "dcp", "ucf"] * args.repeat
    for loader in order[: 2 * args.repeat]:
        _launch(args.load_world_size, [*common, "--phase", "resume", "--loader", loader])
    saved = json.loads((work / "saved.json").read_text())["digest"]
    runs = [json.loads(line) for line in (work / "runs.jsonl").read_text().splitlines()]
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    lines = [
        f"FSDP2 MLP, {args.layers} x Linear({args.hidden}, {args.hidden}) = {params / 1e6:.1f}M "
        f"fp32 params + AdamW state, saved at W = {args.save_world_size}, resumed at "
        f"W = {args.load_world_size}; store {_mib(_size(work / 'ckpt.ucf'))}, DCP folder "
        f"{_mib(_size(work / 'ckpt.dcp'))}; mean of {args.repeat} fresh jobs each.",
        "",
        "| loader | seconds per rank | job seconds | bytes read per rank | same state |",
        "|---|---|---|---|---|",
    ]
    names = {"ucf": "ucformat.torch.load (store)", "dcp": "dcp.load + set_state_dict (DCP)"}
    for loader in ("dcp", "ucf"):
        mine = [r for r in runs if r["loader"] == loader]
        world = args.load_world_size
        seconds = [statistics.mean(r["seconds"][i] for r in mine) for i in range(world)]
        read = [statistics.mean(r["bytes_read"][i] for r in mine) for i in range(world)]
        job = statistics.mean(r["job_seconds"] for r in mine)
        same = all(r["digest"] == saved for r in mine)
        lines.append(
            f"| {names[loader]} | {', '.join(f'{s:.2f}' for s in seconds)} | {job:.2f} | "
            f"{', '.join(_mib(b) for b in read)} | {'yes' if same else 'NO'} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
