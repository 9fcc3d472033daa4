"""Move runs between DeepSpeed ZeRO and PyTorch FSDP2 / HSDP through a ucformat store.

Every case runs inside one of three torchrun launches (CPU, gloo; tests/fixtures/run_fsdp.py,
worker tests/fixtures/_fsdp_worker.py):

* DeepSpeed ZeRO-1/2/3 grid checkpoints (fp32, bf16, fp16; tied, frozen, buffers, two param
  groups, sub-groups) -> ``ucformat convert`` -> a fresh FSDP2 model (1-D meshes of 2, 3, 4
  ranks, and HSDP on a 2 x 2 mesh, never the source's world size) via ``ucformat.torch.load``:
  every gathered param and optimizer state equals DeepSpeed's truth bit for bit, optimizer
  states are DTensors placed like their params, step is torch's float32 tensor, the
  fixed-batch loss equals a plain single-process model's holding the same weights, and one
  more training step works;
* FSDP2 at 2 ranks and HSDP at 4 -> ``ucformat.torch.save`` -> DeepSpeed ZeRO-1, -2 and -3 at
  3 ranks via ``ucformat.deepspeed.load``, and FSDP2 at 3 ranks: bit-exact against the saving
  job's gathered state;
* read cost: each rank's bytes read equal the read planner's prediction byte for byte, and
  for the ~1.6M-param model they are within 1.1x of the bytes the rank needs;
* bad input: a model that does not match the store fails with one line naming the params and
  changes nothing; a save onto an existing store without ``overwrite`` fails on every rank, and
  a save in which one rank cannot write raises on every rank and commits nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.run_fsdp import DS_LOADS, SAVES, run_fsdp

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def fsdp_results(ds_grid: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_fsdp(ds_grid, tmp_path_factory.mktemp("fsdp"))


def _check(results: dict[str, Any], name: str) -> dict[str, Any]:
    result: dict[str, Any] = results[name]
    assert result["failures"] == [], "\n".join(result["failures"])
    return result


@pytest.mark.parametrize(("source", "mesh"), DS_LOADS, ids=[f"{s}-{m}" for s, m in DS_LOADS])
def test_deepspeed_to_fsdp2(fsdp_results: dict[str, Any], source: str, mesh: list[int]) -> None:
    result = _check(fsdp_results, f"{source}--to-fsdp-{'x'.join(map(str, mesh))}")
    assert result["bytes_read"] == result["bytes_predicted"], "reads differ from the planner's"
    if "wide" in source:  # params >= 1 MB: the ranks read at most 10% more than they need
        assert sum(result["bytes_read"]) <= 1.1 * sum(result["bytes_needed"])


@pytest.mark.parametrize("name", [name for name, _, _ in SAVES])
def test_fsdp2_save(fsdp_results: dict[str, Any], name: str) -> None:
    result = _check(fsdp_results, name)
    assert "overwrite=True" in result["refused"]


@pytest.mark.parametrize(
    "name",
    [
        "save-ftb-fsdp2-w2--to-z1-ws3",
        "save-ftb-fsdp2-w2--to-z3-ws3",
        "save-multi-hsdp-w4--to-z2-ws3",
        "save-multi-hsdp-w4--to-fsdp-3",
    ],
)
def test_fsdp2_save_resumes_elsewhere(fsdp_results: dict[str, Any], name: str) -> None:
    _check(fsdp_results, name)


@pytest.mark.parametrize(
    "name", ["mismatch-simple-into-multi-store", "mismatch-ftb-into-multi-store-hsdp"]
)
def test_mismatched_model_is_refused(fsdp_results: dict[str, Any], name: str) -> None:
    result = _check(fsdp_results, name)
    assert result["message"].startswith("the model does not match the checkpoint:")
