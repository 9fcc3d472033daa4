"""After ``ucformat.deepspeed.load`` an engine looks exactly as after DeepSpeed's own load.

Differential grid (tests/fixtures/diff_cases.py, run by tests/fixtures/run_diffs.py in one
torchrun launch per world size): each checkpoint is loaded into two identical fresh engines,
once by DeepSpeed (``engine.load_checkpoint``: its native files at the saved world size, or
``ds_to_universal`` + ``load_universal`` at another one) and once by ucformat. Each rank's raw
state (``module.state_dict()`` as ZeRO leaves it, ZeRO-3 parameter status and 16-bit
partitions, fp32 partitions, the base optimizer's ``state_dict()``, loss scaler, lr scheduler,
counters) must be equal field by field, bit for bit, right after the load and after one more
training step (whose loss must be equal too). The fields where DeepSpeed's own loader is wrong
are listed with the reason in ``diff_cases.deliberate``: there ucformat's value must equal the
saved engine's truth, and the difference must really show (the list cannot go stale).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.diff_cases import DIFFS, deliberate
from tests.fixtures.ds_cases import by_name

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def ds_diffs(ds_grid: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Results of every differential case, run once per module."""
    from tests.fixtures.run_diffs import run_diffs

    return run_diffs(DIFFS, ds_grid, tmp_path_factory.mktemp("diffs"))


@pytest.mark.parametrize("name", [diff.name for diff in DIFFS])
def test_same_engine_as_deepspeed_load(name: str, ds_diffs: dict[str, dict[str, Any]]) -> None:
    result = ds_diffs[name]
    assert result["failures"] == [], "\n".join(result["failures"])
    assert all(n > 20 for n in result["fields"]), "too few fields observed"
    for item in result["deliberate"]:
        assert item["seen"] and item["reason"], item


def test_grid_covers_what_the_issue_asks_for() -> None:
    cases = [by_name()[d.source] for d in DIFFS]
    assert {c.stage for c in cases} == {1, 2, 3}
    assert {c.dtype for c in cases} == {"fp32", "fp16", "bf16"}
    assert any(c.bf16_optimizer for c in cases)
    assert any(c.sub_group_size for c in cases)
    assert {"multi", "ftb", "wide"} <= {c.model for c in cases}
    assert {d.reference for d in DIFFS} == {"native", "universal"}
    assert {d.load_optimizer_states for d in DIFFS} == {True, False}
    universal = [(by_name()[d.source], d) for d in DIFFS if d.reference == "universal"]
    assert all(c.world_size != d.world_size for c, d in universal)
    assert {c.stage for c, _ in universal} >= {1, 2, 3}
    assert {d.load_optimizer_states for d in DIFFS if by_name()[d.source].stage == 3} == {
        True,
        False,
    }
    # the known DeepSpeed defects are in the grid, each with its reason
    reasons = " ".join(item.reason for d in DIFFS for item in deliberate(d))
    for fact in ("frozen", "buffers", "group 0", "16-bit weights", "rank 0"):
        assert fact in reasons, fact
