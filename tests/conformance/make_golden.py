"""Write the golden stores of tests/conformance/golden and their expected values.

Each golden store is a real DeepSpeed checkpoint (tests/fixtures/data, or the cached fixture grid
of ``UCFORMAT_GRID_CACHE`` for cases not committed, or, for ``dtype-zoo``, one saved here by
:mod:`tests.conformance._dtype_zoo_worker` under torchrun) converted with tiny chunks and shards, so
that arrays have several chunks and shards and last chunks and shards overhang the array's edge
(docs/format.md §2.2). Next to each store, ``expected/<store>/`` holds what a conforming reader
must return, taken from ``truth.pt``, which the live DeepSpeed engine dumped when it saved the
checkpoint (never from the store itself):

* ``values.json``: per array path, its logical dtype, shape and ``.npy`` file; per parameter,
  its scalar states (``{"kind", "value", "dtype"}``); tied names; optimizer group members;
* ``<array path>.npy``: the values, little-endian, in the array's logical dtype; ``bfloat16`` as
  ``uint16`` bit patterns (numpy has no bfloat16).

``v1.0-*`` stores were written by an older ucformat (format 1.0) and are never regenerated: only
their expected values are. Run from the repository root::

    UCFORMAT_GRID_CACHE=/path/to/grid python -m tests.conformance.make_golden
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ucformat.format.dtypes import dtype_name
from ucformat.write.convert import convert

HERE = Path(__file__).parent
GOLDEN = HERE / "golden"
EXPECTED = HERE / "expected"
COMMITTED = HERE.parent / "fixtures" / "data"

#: Tiny chunks and shards: several of each per array, and overhanging edges.
CHUNK_BYTES = 64
SHARD_BYTES = 192


#: Not a fixture case: the checkpoint :mod:`tests.conformance._dtype_zoo_worker` saves.
ZOO = "dtype-zoo"


@dataclass(frozen=True)
class Golden:
    """One golden store: the fixture case it comes from and how it is written."""

    name: str
    case: str
    compressor: str = "none"
    chunk_bytes: int = CHUNK_BYTES
    shard_bytes: int = SHARD_BYTES
    #: format-1 stores: frozen values under "fp32" (written by ucformat 0.1.0, not regenerated)
    legacy: bool = False
    #: The format version of a store an older writer wrote, kept as it is (never regenerated:
    #: the reader must go on reading it); None: written by the current writer.
    frozen: str | None = None

    @property
    def version(self) -> str | None:
        """The store's ``format_version`` when it is frozen (None: the current writer's)."""
        return "1.0" if self.legacy else self.frozen


GOLDENS = (
    # Format 2.0 (written by ucformat before format 2.1, kept as they are):
    # fp16 training: fp16 frozen params, tied embedding, fp32 + int64 buffers, torch Adam's
    # float32 0-d `step` tensors, uncompressed
    Golden("z1-fp16-tadam-ftb", "z1-fp16-tadam-ftb-ws2", frozen="2.0"),
    # bf16 training under ZeRO-3: bf16 frozen params, tied, buffers, FusedAdam's int step, zstd
    Golden("z3-bf16-dsadam-ftb-zstd", "z3-bf16-dsadam-ftb-ws4", compressor="zstd", frozen="2.0"),
    # fp32 training, ZeRO-2 at world size 3: fp32 frozen params, tied, buffers
    Golden("z2-fp32-dsadam-ftb", "z2-fp32-dsadam-ftb-ws3", frozen="2.0"),
    # several optimizer groups, fp16 under ZeRO-3
    Golden("z3-fp16-tadam-multi", "z3-fp16-tadam-multi-ws2", frozen="2.0"),
    # buffers of every other dtype (float64, int32, int16, int8, uint8, bool, ...), ZeRO-2
    Golden("dtype-zoo", ZOO, chunk_bytes=8, shard_bytes=16, frozen="2.0"),
    # Format 1.0 (ucformat 0.1.0's first format)
    Golden("v1.0-z1-fp16-tadam-ftb", "z1-fp16-tadam-ftb-ws2", legacy=True),
    # Format 3.0: box chunks (written by the format-3.0 writer with tp_max 2, dp_max 2 and box
    # chunks from 256 bytes on; one array per (parameter, state), keys with '/')
    Golden("v3.0-z2-fp32-dsadam-ftb-box", "z2-fp32-dsadam-ftb-ws3", frozen="3.0"),
)


def save_dtype_zoo(out: Path) -> Path:
    """Run the dtype-zoo DeepSpeed job (torchrun, one CPU rank) into ``out``; return it."""
    worker = HERE / "_dtype_zoo_worker.py"
    from tests.launch import run_in_group, torchrun_command

    done = run_in_group(torchrun_command(1, [str(worker), str(out)]), timeout_s=600, capture=True)
    if done.returncode != 0:
        raise RuntimeError(f"dtype-zoo job failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return out


def case_dir(case: str) -> Path:
    """The fixture folder of ``case``: committed, else in the grid cache."""
    committed = COMMITTED / case
    if committed.is_dir():
        return committed
    cache = os.environ.get("UCFORMAT_GRID_CACHE")
    if cache and (Path(cache) / case).is_dir():
        return Path(cache) / case
    raise SystemExit(f"{case}: not in {COMMITTED}; set UCFORMAT_GRID_CACHE to the fixture grid")


def npy_values(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as numpy, bfloat16 as its uint16 bit patterns."""
    tensor = tensor.detach().contiguous().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def expected_values(truth: dict[str, Any], legacy: bool) -> dict[str, Any]:
    """What the store must hold, from the engine's own dump: {path: tensor} and metadata."""
    arrays: dict[str, torch.Tensor] = {}
    for name, value in truth["fp32"].items():
        arrays[f"params/{name}/fp32"] = value
    for name, states in (truth["optim"] or {}).items():
        for key, value in states.items():
            arrays[f"params/{name}/{key}"] = value
    for name, value in truth["frozen"].items():
        arrays[f"params/{name}/{'fp32' if legacy else 'value'}"] = value
    for name, value in truth["buffers"].items():
        arrays[f"buffers/{name}"] = value
    scalars: dict[str, dict[str, Any]] = {}
    for name, step in (truth["step"] or {}).items():
        if isinstance(step, torch.Tensor):
            scalars[name] = {
                "step": {"kind": "tensor", "dtype": dtype_name(step.dtype), "value": step.item()}
            }
        else:
            scalars[name] = {"step": {"kind": type(step).__name__, "value": step}}
    groups = [list(group["param_names"]) for group in truth["param_groups"]]
    return {"arrays": arrays, "scalars": scalars, "tied": truth["shared_params"], "groups": groups}


def write_expected(golden: Golden, truth: dict[str, Any]) -> None:
    """Write ``expected/<golden.name>/``: values.json and one .npy per array."""
    out = EXPECTED / golden.name
    shutil.rmtree(out, ignore_errors=True)
    want = expected_values(truth, golden.legacy)
    index: dict[str, Any] = {}
    for path, tensor in want["arrays"].items():
        file = f"{path}.npy"
        (out / file).parent.mkdir(parents=True, exist_ok=True)
        np.save(out / file, npy_values(tensor), allow_pickle=False)
        index[path] = {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "npy": file}
    document = {
        "store": golden.name,
        "case": golden.case,
        "arrays": index,
        "scalars": want["scalars"],
        "tied": want["tied"],
        "groups": want["groups"],
    }
    (out / "values.json").write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")


def main() -> None:
    """(Re)write every golden store of the current writer (not the frozen ones of older
    formats) and every expected folder."""
    scratch = Path(tempfile.mkdtemp(prefix="ucf-golden-"))
    try:
        for golden in GOLDENS:
            source = save_dtype_zoo(scratch / ZOO) if golden.case == ZOO else case_dir(golden.case)
            if golden.version is None:
                convert(
                    source / "ckpt",
                    GOLDEN / golden.name,
                    overwrite=True,
                    chunk_bytes=golden.chunk_bytes,
                    shard_bytes=golden.shard_bytes,
                    compressor=golden.compressor,
                    workers=1,
                )
            write_expected(golden, torch.load(source / "truth.pt", weights_only=True))
            print(f"wrote {golden.name} from {golden.case}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
