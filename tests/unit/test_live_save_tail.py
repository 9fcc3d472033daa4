"""The one live-save tail: the binding's plan step runs inside the agreement."""

from __future__ import annotations

from pathlib import Path

import pytest

from ucformat.errors import UnsupportedCheckpointError
from ucformat.write.live_save import LiveTarget, prepare_live_save
from ucformat.write.plan import ConvertPlan, PlanLayout


def test_a_failing_plan_step_is_raised_as_it_is_in_one_process(tmp_path: Path) -> None:
    seen: list[LiveTarget] = []

    def plan(target: LiveTarget, kept: PlanLayout | None) -> ConvertPlan:
        assert kept is None  # nothing saved from this owner before
        seen.append(target)
        raise UnsupportedCheckpointError(f"{target.where}: no")

    owner = type("Owner", (), {})()
    with pytest.raises(UnsupportedCheckpointError, match=r"ucformat\.torch\.save: no$"):
        prepare_live_save(
            tmp_path / "s", api="ucformat.torch.save", copy_all=True, owner=owner, plan=plan
        )
    (target,) = seen
    assert target.where == f"{tmp_path / 's'}: ucformat.torch.save"
    assert target.location == str(tmp_path / "s") and target.copies.always
    assert not (tmp_path / "s").exists()  # nothing was opened or written
