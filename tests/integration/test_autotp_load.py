"""``ucformat.deepspeed.load`` into AutoTP engines equals DeepSpeed's own universal load.

Stores converted from AutoTP checkpoints (tests/fixtures/autotp_cases.py) are loaded at tp1 x dp1,
tp1 x dp2, tp2 x dp1 and across ZeRO stages 1 <-> 2, and a data-parallel-only store (saved live
from a tp1 engine) is loaded into a tp2 engine; tp2 ZeRO-1 stores go into ZeRO-3 engines at
tp2 x dp1 (fp32) and tp1 x dp2 (bf16), and the tp2 x dp2 ZeRO-3 store into a tp2 x dp1 ZeRO-1
engine. Each is compared, field by field, with the same
engine after DeepSpeed's ``load_checkpoint`` of its ``ds_to_universal`` output, then both train
one more step: equal losses, equal state. One more load compares ucformat's load with a stock
``load_checkpoint`` of the store's native AutoTP export (``export deepspeed --tp 2``).

DeepSpeed's universal load cannot cross the ZeRO-3 boundary, so a load across it is compared per
parameter with DeepSpeed's universal load of the same source at the same tp x dp, at ZeRO-1 (or
ZeRO-3 from the ZeRO-3 source): fp32 shards, optimizer states, step, 16-bit weights; a bf16 tp1
target's next loss also equals a plain ``LlamaForCausalLM`` holding the same weights
(tests/fixtures/_autotp_zero3.py).
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


@pytest.mark.parametrize(
    "load",
    [
        "tp2dp2-z2-fp32--to-tp2dp1-z1",
        "tp2dp1-z1-fp32--to-tp2dp1-z3",
        "tp2dp2-z1-bf16--to-tp1dp2-z3",
    ],
)
def test_each_rank_reads_only_its_slice(load: str, autotp_loads: dict[str, dict[str, Any]]) -> None:
    """At tp2 x dp1 (or tp1 x dp2 at ZeRO-3) every rank needs about half of the model: read
    amplification stays small (whole chunks: these tiny arrays are one chunk each)."""
    for rank in autotp_loads[load]["ranks"]:
        assert 0 < rank["bytes_needed"] <= rank["bytes_read"] <= 4 * rank["bytes_needed"]
