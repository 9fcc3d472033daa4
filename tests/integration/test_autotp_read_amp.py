"""An AutoTP load reads what each rank needs, within 1.2x, on matrices of 1 MiB and more.

The AutoTP Llama of tests/fixtures/autotp_cases.py widened (``UCFORMAT_AUTOTP_WIDE=1``: hidden
512, MLP 1024, so q/o 1 MiB and gate/up/down 2 MiB fp32 matrices, box-chunked by default) is
trained by DeepSpeed at tp 2 x dp 1, ZeRO-1, converted, and loaded with
``ucformat.deepspeed.load`` at tp 2 x dp 1 (row-parallel slices: columns) and tp 1 x dp 2 (ZeRO
partitions: flat ranges). Each load is compared with DeepSpeed's own universal load of the same
checkpoint (no failures), and every rank's ``LoadReport`` bytes read stay within 1.2x of the
bytes it needs (docs/benchmarks.md). The wide checkpoint has its own cache folder.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import deepspeed_available
from tests.fixtures.make_fixtures import REPO_ROOT

pytestmark = pytest.mark.deepspeed

WIDE_CACHE = REPO_ROOT / "tests" / ".cache" / "autotp_wide"


@pytest.fixture(scope="module")
def wide_loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both loads of the wide checkpoint (run once)."""
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    from tests.fixtures.autotp_cases import (
        AutoTPCase,
        AutoTPLoad,
        generate_autotp,
        run_autotp_loads,
    )

    case = AutoTPCase(2, 1, 1, "fp32")
    loads = (AutoTPLoad(case.name, 2, 1, 1), AutoTPLoad(case.name, 1, 2, 1))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCFORMAT_AUTOTP_WIDE", "1")  # read here and by the torchrun workers
        fixtures = generate_autotp((case,), WIDE_CACHE)
        return run_autotp_loads(loads, fixtures, tmp_path_factory.mktemp("autotp-wide"))


@pytest.mark.parametrize("target", ["tp2dp1-z1", "tp1dp2-z1"])
def test_wide_autotp_load_reads_within_1_2x(
    wide_loads: dict[str, dict[str, Any]], target: str
) -> None:
    (name,) = [name for name in wide_loads if name.endswith(f"--to-{target}")]
    ranks = wide_loads[name]["ranks"]
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["failures"] == [], rank["failures"][:5]
        assert rank["bytes_needed"] > 2**20 * 3, rank  # the wide matrices are really there
        ratio = rank["bytes_read"] / rank["bytes_needed"]
        assert ratio <= 1.2, f"rank {rank['rank']} read {ratio:.3f}x what it needs"
