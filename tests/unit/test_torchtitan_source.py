"""ucformat.sources.torchtitan: torchtitan's ``train_state.step`` becomes the store's progress."""

from __future__ import annotations

from typing import Any

import pytest

from ucformat.sources.torchtitan import TRAIN_STEP_KEY, training_progress


def test_torchtitan_step_is_the_global_step() -> None:
    values = {TRAIN_STEP_KEY: 300, "train_state.ntokens_seen": 12345, "lr_scheduler.x": 1}
    assert training_progress(values).global_steps == 300


@pytest.mark.parametrize(
    "values",
    [{}, {TRAIN_STEP_KEY: True}, {TRAIN_STEP_KEY: -1}, {TRAIN_STEP_KEY: "3"}, {"step": 3}],
)
def test_anything_else_records_no_progress(values: dict[str, Any]) -> None:
    progress = training_progress(values)
    assert (progress.global_steps, progress.global_samples) == (0, 0)
