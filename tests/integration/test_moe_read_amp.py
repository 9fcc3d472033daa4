"""An MoE load reads what each rank needs, within 1.2x, on expert matrices of 1 MiB.

The native-MoE model of tests/fixtures/moe_cases.py widened (``UCFORMAT_MOE_WIDE=1``: hidden 256,
expert FFN 1024 in the first MoE layer and 1536 in the second, so every expert's up and down
matrices are 1 or 1.5 MiB fp32; 2 MoE layers of 4 experts) is trained by DeepSpeed at ep 2 x dp 1
(W=2), ZeRO-1, converted, and loaded with ``ucformat.deepspeed.load`` at ep 1 x dp 2 (every
expert, ZeRO partitions: flat ranges, the cut inside a 1.5 MiB matrix) and at ep 2 x dp 1 (each
rank its 2 experts per layer, whole). Each load's own checks pass (every state
exact against the training job's, next losses equal the uninterrupted run's), and every rank's
``LoadReport`` bytes read stay within 1.2x of the bytes it needs (docs/benchmarks.md). The wide
checkpoint has its own cache folder.
"""

from __future__ import annotations

from typing import Any

import pytest

import ucformat
from tests.conftest import deepspeed_available
from tests.fixtures.make_fixtures import REPO_ROOT

pytestmark = pytest.mark.deepspeed

WIDE_CACHE = REPO_ROOT / "tests" / ".cache" / "moe_wide"
#: Per rank, either layout holds 2 experts' worth of each layer's (up, down) matrices (1 and
#: 1.5 MiB) in fp32 + 2 Adam moments: 30 MiB.
WIDE_BYTES = 2 * 2 * 3 * (2**20 + 3 * 2**19)
#: target name -> (ep_size, ZeRO stage) at W=2
TARGETS = {"ep1dp2-z1": (1, 1), "ep2dp1-z1": (2, 1)}


@pytest.fixture(scope="module")
def wide_loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both loads of the wide checkpoint (run once)."""
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    from tests.fixtures.moe_cases import MoeCase, generate_moe, run_moe_loads

    case = MoeCase("ep2-z1-top1-ws2-wide", 2, 2, 1, 1, steps=2)
    work = tmp_path_factory.mktemp("moe-wide")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCFORMAT_MOE_WIDE", "1")  # read here and by the torchrun workers
        folder = generate_moe(WIDE_CACHE, (case,))[case.name]
        store = work / "wide.ucf"
        ucformat.convert(folder / "ckpt", store)
        jobs = []
        for target, (ep, stage) in TARGETS.items():
            name = f"{case.name}-to-{target}"
            layout = {"name": name, "world_size": 2, "ep_size": ep, "stage": stage, "k": case.k}
            jobs.append(
                {
                    "name": name,
                    "case": {**layout, "steps": case.steps},
                    "store": str(store),
                    "truth": str(folder / "truth.pt"),
                    "first_step": case.steps,
                }
            )
        return run_moe_loads(jobs, work)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_wide_moe_load_reads_within_1_2x(
    wide_loads: dict[str, dict[str, Any]], target: str
) -> None:
    ranks = wide_loads[f"ep2-z1-top1-ws2-wide-to-{target}"]["ranks"]
    assert len(ranks) == 2
    for rank, record in enumerate(ranks):
        assert record["failures"] == [], record["failures"][:5]
        assert record["bytes_needed"] >= WIDE_BYTES, record  # the wide experts are really there
        ratio = record["bytes_read"] / record["bytes_needed"]
        print(
            f"{target} rank {rank}: {record['bytes_read']} / {record['bytes_needed']} = {ratio:.4f}"
        )
        assert ratio <= 1.2, f"rank {rank} read {ratio:.3f}x what it needs"
