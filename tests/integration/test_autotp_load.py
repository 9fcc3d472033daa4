"""``ucformat.deepspeed.load`` into AutoTP engines equals DeepSpeed's own universal load.

Stores converted from AutoTP checkpoints (tests/fixtures/autotp_cases.py) are loaded at tp1 x dp1,
tp1 x dp2, tp2 x dp1 and across ZeRO stages 1 <-> 2, and a data-parallel-only store (saved live
from a tp1 engine) is loaded into a tp2 engine. Each is compared, field by field, with the same
engine after DeepSpeed's ``load_checkpoint`` of its ``ds_to_universal`` output, then both train
one more step: equal losses, equal state. One more load compares ucformat's load with a stock
``load_checkpoint`` of the store's native AutoTP export (``export deepspeed --tp 2``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import deepspeed_available
from tests.fixtures.autotp_cases import LOADS

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def autotp_loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The results of every AutoTP load (run once per session)."""
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed")
    from tests.fixtures.autotp_cases import generate_autotp, run_autotp_loads

    return run_autotp_loads(LOADS, generate_autotp(), tmp_path_factory.mktemp("autotp-loads"))


@pytest.mark.parametrize("load", [load.name for load in LOADS])
def test_autotp_load_equals_deepspeed_universal_load(
    load: str, autotp_loads: dict[str, dict[str, Any]]
) -> None:
    result = autotp_loads[load]
    assert result["failures"] == []
    losses = {r["loss"] for r in result["ranks"]}
    assert all(isinstance(loss, float) for loss in losses)


def test_each_rank_reads_only_its_slice(autotp_loads: dict[str, dict[str, Any]]) -> None:
    """At tp2 x dp1 every rank needs about half of the model: read amplification stays small."""
    for rank in autotp_loads["tp2dp2-z2-fp32--to-tp2dp1-z1"]["ranks"]:
        assert 0 < rank["bytes_needed"] <= rank["bytes_read"] <= 4 * rank["bytes_needed"]
