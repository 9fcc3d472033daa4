"""The convert reports its last phases (source check, commit) to the progress display."""

from __future__ import annotations

from pathlib import Path

import ucformat
from ucformat.write.convert import ConvertHooks

DATA = Path(__file__).resolve().parents[1] / "fixtures" / "data"


def test_phases_are_reported_before_the_commit(tmp_path: Path) -> None:
    store = tmp_path / "a.ucf"
    seen: list[tuple[str, bool]] = []

    def on_phase(phase: str) -> None:
        seen.append((phase, (store / "ucformat.json").exists()))

    ucformat.convert(
        DATA / "z2-fp32-dsadam-ftb-ws3" / "ckpt", store, hooks=ConvertHooks(on_phase=on_phase)
    )
    assert seen == [
        ("checking the source's CRC-32s", False),
        ("committing (fsync of every object)", False),
    ]
    assert (store / "ucformat.json").exists()
