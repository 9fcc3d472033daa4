"""Peak memory of ``export safetensors`` against the model size (a benchmark, not a test).

Builds a synthetic ucformat store (random fp32 weights written through ucformat's own zarr
layer; no DeepSpeed needed), then runs, each in a fresh process, and reports the peak resident
memory above the process's baseline (imports done, store opened):

* ``export``: ``export_safetensors`` (streams pieces of ``--piece-mib``);
* ``read-all``: reading every parameter into memory first, as a whole-state-dict converter does
  (``zero_to_fp32.py`` holds the merged fp32 state dict, about 2x the model with its
  intermediate copies).

Usage::

    python -m tests.bench.export_safetensors_memory --gib 1 --work /tmp/ucf_bench
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MIB = 2**20


def build_store(path: Path, params: int, numel: int) -> None:
    """A committed store of ``params`` fp32 parameters of ``numel`` elements each."""
    import zarr

    from tests.helpers import source_info
    from ucformat.format.models import ArrayRef, CheckpointManifest, ParamEntry
    from ucformat.format.spec import FORMAT_NAME, FORMAT_VERSION, MANIFEST_KEY, state_array_path
    from ucformat.layout.chunking import ChunkPolicy, choose_chunking
    from ucformat.store.arrays import create_array
    from ucformat.store.keys import open_store
    from ucformat.store.manifest_io import commit_manifest

    store = open_store(path, read_only=False)
    attributes = {FORMAT_NAME: {"format_version": FORMAT_VERSION, "manifest": MANIFEST_KEY}}
    zarr.create_group(store, overwrite=True, zarr_format=3, attributes=attributes)
    rng = np.random.default_rng(0)
    entries = {}
    for index in range(params):
        name = f"layers.{index}.weight"
        shape = [numel // 1024, 1024]
        chunking = choose_chunking(shape, 4, ChunkPolicy())
        ref = ArrayRef(
            path=state_array_path(name, "fp32"),
            dtype="float32",
            shape=shape,
            chunk_shape=list(chunking.chunk_shape),
            shard_shape=list(chunking.shard_shape),
            nbytes=numel * 4,
        )
        array = create_array(store, ref)
        array[...] = rng.standard_normal(shape, dtype=np.float32)
        entries[name] = ParamEntry(
            shape=shape, dtype="float32", requires_grad=False, group=None, states={"fp32": ref}
        )
    manifest = CheckpointManifest(
        created_by="benchmark",
        source=source_info(
            framework_version="0",
            path="synthetic",
            tag="bench",
            world_size=1,
            train_dtype="float32",
            optimizer_wrapper="none",
        ),
        params=entries,
    )
    commit_manifest(store, manifest)


def measure(mode: str, store: Path, out: Path, piece_mib: int) -> dict[str, float]:
    """Run in this process: baseline RSS, then ``mode``; return peaks in MiB."""
    import ucformat
    from ucformat.export import export_safetensors

    ckpt = ucformat.open(store)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    if mode == "export":
        export_safetensors(ckpt, out, overwrite=True, piece_bytes=piece_mib * MIB)
    else:
        tensors = {name: ckpt.read(name, "fp32") for name in ckpt.manifest.params}
        del tensors
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"baseline_mib": baseline, "peak_mib": peak, "seconds": time.perf_counter() - started}


def main() -> int:
    """Build the store once, then measure each mode in a fresh process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="model size (fp32)")
    parser.add_argument("--params", type=int, default=16)
    parser.add_argument("--piece-mib", type=int, default=64)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ucf_bench"))
    parser.add_argument("--child", nargs=2, metavar=("MODE", "STORE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, store = args.child
        print(json.dumps(measure(mode, Path(store), args.work / "hf", args.piece_mib)))
        return 0
    numel = int(args.gib * 2**30 / 4 / args.params) // 1024 * 1024
    store = args.work / f"synthetic-{args.gib:g}gib.ucf"
    if not (store / "ucformat.json").exists():
        build_store(store, args.params, numel)
    model_mib = args.params * numel * 4 / MIB
    print(f"model: {args.params} x {numel} fp32 = {model_mib:.0f} MiB; piece {args.piece_mib} MiB")
    for mode in ("export", "read-all"):
        command = [
            sys.executable, "-m", "tests.bench.export_safetensors_memory", "--work",
            str(args.work), "--piece-mib", str(args.piece_mib), "--child", mode, str(store),
        ]  # fmt: skip
        result = json.loads(subprocess.run(command, check=True, capture_output=True).stdout)
        extra = result["peak_mib"] - result["baseline_mib"]
        print(f"{mode:9s} peak above baseline {extra:7.0f} MiB ({extra / model_mib:.2f} x model), "
              f"{result['seconds']:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
