"""A pipeline load reads what each rank needs, within 1.2x, on matrices of 1 and 2 MiB.

The ``PipelineModule`` of tests/fixtures/pp_cases.py widened (``UCFORMAT_PIPELINE_WIDE=1``: width
512, so a 1 MiB (512 x 512) tied embedding/head and 2 MiB (512 x 1024, 1024 x 512) fp32 Linear
weights) is trained by DeepSpeed at pp 2 x dp 1, ZeRO-1, converted, and loaded with
``ucformat.deepspeed.load`` at pp 1 x dp 2 (every layer, ZeRO partitions: flat ranges, the cut
inside a 2 MiB matrix) and at pp 2 x dp 1 (each stage its own layers and the tied one, whole).
Each load's own checks pass (every state equal to the saved one; at pp 2 x dp 1, the same
batches, the next losses equal the uninterrupted run's), and every rank's ``LoadReport`` bytes
read stay within 1.2x of the bytes it needs (docs/benchmarks.md). The wide checkpoint has its
own cache folder.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest

import ucformat
from tests.conftest import deepspeed_available
from tests.fixtures.make_fixtures import REPO_ROOT

pytestmark = pytest.mark.deepspeed

WIDE_CACHE = REPO_ROOT / "tests" / ".cache" / "pipeline_wide"
#: Per rank, either layout holds at least 2.5 MiB of wide weights x (fp32 + 2 Adam moments).
WIDE_BYTES = 3 * 5 * 2**19
#: target name -> (pp, dp) at W=2
TARGETS = {"pp1dp2": (1, 2), "pp2dp1": (2, 1)}


@pytest.fixture(scope="module")
def wide_loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both loads of the wide checkpoint (run once)."""
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    from tests.fixtures.pp_cases import PipeCase, generate_pipeline, run_pipeline_jobs

    case = PipeCase("pp2dp1-z1-fp32-tied-wide", 2, 1, 1, "fp32", True)
    work = tmp_path_factory.mktemp("pipeline-wide")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCFORMAT_PIPELINE_WIDE", "1")  # read by pp_cases and the torchrun workers
        folder = generate_pipeline(WIDE_CACHE, (case,))[case.name]
        store = work / "wide.ucf"
        ucformat.convert(folder / "ckpt", store)
        jobs = [
            {
                "kind": "load", "name": target, "case": asdict(case), "dir": str(folder),
                "store": str(store), "universal": None,
                "target": {"pp": pp, "dp": dp, "plain": False}, "world_size": pp * dp,
            }
            for target, (pp, dp) in TARGETS.items()
        ]  # fmt: skip
        return run_pipeline_jobs(jobs, work)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_wide_pipeline_load_reads_within_1_2x(
    wide_loads: dict[str, dict[str, Any]], target: str
) -> None:
    result = wide_loads[target]
    assert result["failures"] == [], result["failures"][:5]
    if target == "pp2dp1":  # the source's layout: the same batches as the uninterrupted run
        assert result["uninterrupted"] == result["losses"]
    reads, needs = result["bytes_read"], result["bytes_needed"]
    assert len(reads) == len(needs) == 2
    for rank, (read, needed) in enumerate(zip(reads, needs, strict=True)):
        assert needed >= WIDE_BYTES, (rank, needed)  # the wide matrices are really there
        ratio = read / needed
        print(f"{target} rank {rank}: {read} / {needed} = {ratio:.4f}")
        assert ratio <= 1.2, f"rank {rank} read {ratio:.3f}x what it needs"
